"""The core's ``TPPlan`` as DTensor ``parallelize_module`` styles, and the norms of gradients that
live on two meshes.

transformers' style names mean what its own layers do (``transformers.distributed.tensor_parallel``);
each maps to torch's ``ColwiseParallel`` / ``RowwiseParallel`` with the same input and output layouts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardcore.backend import release
from shardcore.config import ShardConfig
from shardcore.errors import ShardConfigError
from shardcore.ties import ties_kept
from shardcore.tp import TPPlan

#: torch releases on which the suite certified ``torch_compile`` with ``tp_size`` (the tp family's
#: compiled case, 2026-12-07); releases between were not run
COMPILED_TP_CERTIFIED = ("2.9", "2.13")


def compiled_tp_certified(version: str = torch.__version__) -> bool:
    """Whether the suite certified ``torch_compile`` with ``tp_size`` on this torch release."""
    return "%d.%d" % release(version) in COMPILED_TP_CERTIFIED


def check_compiled_tp(config: ShardConfig, version: str = torch.__version__) -> None:
    """Refuse ``torch_compile`` with ``tp_size`` > 1 on a torch release the suite has not certified it on."""
    if not (config.torch_compile and config.tp_size > 1) or compiled_tp_certified(version):
        return
    raise ShardConfigError(
        "torch_compile",
        f"true with tp_size {config.tp_size} is certified on torch {', '.join(COMPILED_TP_CERTIFIED)} only, and this "
        f"is torch {version}, which the conformance suite has not run compiled tensor parallelism on (torch's "
        "compiler has given a split layer's input no gradient before: docs/tensor_parallel.md). Set "
        f"torch_compile: false, or use torch {' or '.join(COMPILED_TP_CERTIFIED)}.",
    )


def torch_style(style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise, rowwise = _settled_output(ColwiseParallel), _settled_output(RowwiseParallel)
    if style == "colwise":
        return _shared_input(colwise)()
    if style in ("colwise_gather_output", "colwise_rep"):
        return _shared_input(colwise)(output_layouts=Replicate())
    if style == "embedding_colwise":
        return colwise(output_layouts=Replicate())
    if style == "rowwise":
        return rowwise()
    if style in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
        return rowwise(input_layouts=Replicate())
    raise AssertionError(f"style {style!r} passed config validation but has no DTensor form")  # pragma: no cover


def _settled_output(style: type) -> type:
    """``style`` whose output, where it runs eagerly, is summed or gathered before the layer returns.
    DTensor's styles return an ``AsyncCollectiveTensor`` that waits at its first use. On torch 2.13 a
    compiled unit that takes one as its input gives it no gradient: with ``torch_compile`` the
    vocabulary-split embedding (eager, outside the compiled decoder layers) got none. Inside a compiled
    graph the wait stays the compiler's to place."""

    class SettledOutput(style):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            if outputs.placements != output_layouts:
                outputs = outputs.redistribute(placements=output_layouts, async_op=torch.compiler.is_compiling())
            return outputs.to_local() if use_local_output else outputs

    return SettledOutput


#: the styles whose layers take their input whole (Replicate): siblings reading one tensor share it
_SHARES_INPUT = ("colwise", "colwise_gather_output", "colwise_rep")


def _shared_input(colwise: type) -> type:
    """``ColwiseParallel`` whose sibling layers that read one input tensor (attention's q, k and v;
    the MLP's gate and up) share one DTensor of it. Each layer's own would sum its input's gradient
    over the tp ranks by itself: 3 all-reduces per attention and 2 per MLP in backward. Shared,
    autograd adds the partial gradients first, and one all-reduce sums them: Megatron's count."""

    class SharedInputColwise(colwise):
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            shared = getattr(mod, "_shardcore_tp_inputs", None)
            # Not in backward: activation checkpointing's recomputation runs there, may stop before
            # the parent's forward hook empties the cache (which would then keep activations alive),
            # and needs no sharing, since backward follows the first forward's graph.
            if shared is None or torch.compiler.is_compiling() or torch._C._current_graph_task_id() != -1:
                return colwise._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
            # the entry holds the input, so its id names no other tensor while the entry lives
            key = (id(inputs[0]), device_mesh, tuple(input_layouts), tuple(desired_input_layouts))
            hit = shared.get(key)
            if hit is None:
                hit = shared[key] = (
                    inputs[0],
                    colwise._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh),
                )
            return hit[1]

    return SharedInputColwise


def _share_inputs_within_parents(model: nn.Module, plan: TPPlan) -> None:
    """One cache of converted inputs per parent of sharing layers, alive only while the parent's
    forward runs (emptied before and after): it holds the activations it maps."""
    parents: dict[str, dict] = {}
    for name, style in plan.styles:
        if style not in _SHARES_INPUT:
            continue
        parent = name.rpartition(".")[0]
        if parent not in parents:
            cache = parents[parent] = {}
            module = model.get_submodule(parent)
            module.register_forward_pre_hook(lambda *_, c=cache: c.clear())
            module.register_forward_hook(lambda *_, c=cache: c.clear())
        model.get_submodule(name)._shardcore_tp_inputs = parents[parent]


def apply(model: nn.Module, plan: TPPlan, tp_mesh: Any) -> None:
    """Split every module of ``plan`` across ``tp_mesh``. Each module gets new DTensor parameters,
    so a tied weight (embedding and head, both split along dim 0) is tied again afterwards."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = {name: torch_style(style) for name, style in plan.styles}
    with ties_kept(model):
        # src_data_rank None: each rank keeps its slice of its own weights, as fully_shard keeps its
        # shard, with no scatter from the tp group's first rank (which a fake process group, shardcore
        # plan's, cannot run either). Weights that differ between ranks are cpu_ram_efficient_loading's.
        parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    _share_inputs_within_parents(model, plan)
    _fresh_masks_for_split_vocabularies(model, plan)


#: the first torch release on which two vocabulary-split embeddings of one shape and two dtypes
#: worked in one process without :func:`_fresh_masks_for_split_vocabularies` (2.9.0 failed)
MASK_CACHE_FIXED = (2, 13)


def _fresh_masks_for_split_vocabularies(model: nn.Module, plan: TPPlan, version: str = torch.__version__) -> None:
    """Work around torch 2.9's DTensor: an embedding split along the vocabulary marks the ids it
    does not hold in a mask kept on its ``_MaskPartial`` placement. The redistribution planner caches
    its plans by placements that compare equal while their masks are empty, so a second such
    embedding of the same shape whose weight has another dtype (a bf16 model after an fp32 one, in
    one process) gets a cached plan that fills the first one's mask, and its own output fails
    ``assert self.mask_buffer.data is not None``. Emptying the planner's cache before each such
    embedding runs makes it plan with its own placement."""
    if release(version) >= MASK_CACHE_FIXED:
        return
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    for name, style in plan.styles:
        if style == "embedding_rowwise":
            model.get_submodule(name).register_forward_pre_hook(lambda *_: _gen_transform_infos.cache_clear())


def by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by the mesh their gradient lives on (plain tensors in a group of their
    own): DTensor refuses one operation over tensors of two meshes."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values())


def global_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False)
    return total.full_tensor() if isinstance(total, DTensor) else total


def combine_norms(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of the concatenation of several groups, from each group's norm."""
    if len(norms) == 1:
        return norms[0]
    stacked = torch.stack([n.float() for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def global_sq_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared entries over whole tensors: DTensor reduces each mesh's partial sums over the
    ranks that hold distinct shards, and not over those that hold copies."""
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), device=device)
    for g in grads:
        s = g.detach().float().pow(2).sum()
        total = total + (s.full_tensor() if isinstance(s, DTensor) else s).to(device)
    return total
