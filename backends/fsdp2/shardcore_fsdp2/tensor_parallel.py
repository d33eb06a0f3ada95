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

from shardcore.ties import ties_kept
from shardcore.tp import TPPlan


def torch_style(style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style in ("colwise_gather_output", "colwise_rep", "embedding_colwise"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    if style in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    raise AssertionError(f"style {style!r} passed config validation but has no DTensor form")  # pragma: no cover


def apply(model: nn.Module, plan: TPPlan, tp_mesh: Any) -> None:
    """Split every module of ``plan`` across ``tp_mesh``. Each module gets new DTensor parameters,
    so a tied weight (embedding and head, both split along dim 0) is tied again afterwards."""
    from torch.distributed.tensor.parallel import parallelize_module

    with ties_kept(model):
        parallelize_module(model, tp_mesh, {name: torch_style(style) for name, style in plan.styles})


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
