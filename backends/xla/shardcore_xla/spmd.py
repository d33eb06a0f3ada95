"""SPMD FSDPv2 (``xla_fsdp_v2: true``): ``SpmdFullyShardedDataParallel`` over a mesh of every device.

The mesh has axes ``("fsdp", "model")``; one process drives all devices, inputs are sharded along the
batch on the ``fsdp`` axis, and Hugging Face outputs are sharded the way the Trainer's
``shard_output`` does. The units are the plan's, wrapped with XLA FSDP's policy (fsdp.py).

Tensor parallelism (``tp_size`` T > 1): the mesh is ``("fsdp", "tensor")`` of shape (S, T), ``tensor``
innermost as FSDP2's ``tp`` dim. Each weight of the plan (``WrapPlan.tp``) is marked before FSDPv2
wraps the model: its split dim on ``tensor`` and its largest other dim on ``fsdp`` (colwise weights
``("tensor", "fsdp")``, rowwise ``("fsdp", "tensor")``, torchprime's specs), a split bias on both. FSDPv2
shards only what is not marked yet, so every other parameter is sharded on ``fsdp`` and replicated over
``tensor``. The batch is split over the data axes only: every device of one ``tensor`` row gets the same
rows. How a style lays out the activations (gathered output, split input) is the partitioner's choice
here; the weights' splits are what the plan decides.

Hybrid sharding (``dp_replicate_size`` R > 1): the mesh is ``("replicate", "fsdp")`` of shape (R, S).
FSDPv2 shards every parameter over ``fsdp`` only, so each replica row of the mesh holds one sharded
copy, and the batch is sharded along dim 0 over both axes, so each replica gets its own rows. The
compiler then reduces the gradients over both axes. The order ``(replicate, fsdp)`` is the one
torch_xla's ``extra_data_axis`` uses for its default output sharding; shardcore passes its own
``shard_output``, which torch_xla 2.9 neither forwards ``extra_data_axis`` to nor combines with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardcore.config import ShardConfig
from shardcore.errors import ShardConfigError, ShardcoreError
from shardcore.plan import WrapPlan
from shardcore.tp import TPPlan
from shardcore.validate import data_parallel_shape, has_meta_tensors

from .fsdp import plan_policy, to_device_keeping_ties, unit_wrapper

#: the mesh axis HSDP replicates parameters over; FSDPv2 shards them over ``fsdp``
REPLICATE = "replicate"
#: the mesh axis tensor parallelism splits weights over (torchprime's and the Trainer's name)
TENSOR = "tensor"


def check_model(model: nn.Module, config: ShardConfig) -> None:
    """What SPMD cannot fill: one process drives every device, so there are no other ranks to take
    rank 0's weights from; and a ``dp_replicate_size`` x ``dp_shard_size`` that does not factor the
    device count. One controller, so one verdict without collectives."""
    shape(config)
    if config.cpu_ram_efficient_loading and has_meta_tensors(model):
        raise ShardConfigError(
            "cpu_ram_efficient_loading",
            "is true, but under SPMD (xla_fsdp_v2: true) one process drives every device, so it is rank 0 and "
            "must hold the real weights; this model has tensors on the meta device. Load the weights in it.",
        )


def shape(config: ShardConfig) -> tuple[int, int]:
    """``(replicas, shards)`` over every device of the process (raises ShardConfigError)."""
    return data_parallel_shape(config, device_count())


def device_count() -> int:
    """Every device the process's SPMD program spans. Counting them starts the XLA runtime, which
    needs to know its device type: torch_xla raises a bare RuntimeError where it cannot."""
    import torch_xla.runtime as xr

    try:
        return xr.global_runtime_device_count()
    except RuntimeError as e:
        if "PJRT_DEVICE" not in str(e):
            raise
        from shardcore import BackendUnavailableError

        raise BackendUnavailableError(
            f"shardcore: SPMD (xla_fsdp_v2: true) could not start the XLA runtime: torch_xla says {e}. "
            "Set PJRT_DEVICE before the run starts: TPU, CUDA, or CPU (with CPU_NUM_DEVICES for several)."
        ) from e


def enable() -> None:
    """This process's SPMD mode. Global to the process; torch_xla replicates the XLA tensors made
    before it, and a program that already made some (the Trainer's ``TrainingArguments`` makes its
    device when it is created) may crash in the first step: turn it on first."""
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()


def mesh(existing: Any = None, replicas: int = 1, tp: int = 1) -> Any:
    """The process's SPMD mode and its global mesh: every device on ``fsdp``; with ``replicas`` > 1
    ``("replicate", "fsdp")`` of shape (replicas, devices / replicas); with ``tp`` > 1 a ``tensor``
    axis of size ``tp`` after them, innermost. ``existing`` if it is that mesh already."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    enable()
    n = device_count()
    shards = n // (replicas * tp)
    if tp == 1:
        dims, axes = ((n, 1), ("fsdp", "model")) if replicas == 1 else ((replicas, shards), (REPLICATE, "fsdp"))
    else:
        dims, axes = (
            ((shards, tp), ("fsdp", TENSOR)) if replicas == 1 else ((replicas, shards, tp), (REPLICATE, "fsdp", TENSOR))
        )
    if existing is not None and tuple(existing.mesh_shape) == dims and tuple(existing.axis_names) == axes:
        return existing
    out = xs.Mesh(np.arange(n), dims, axes)
    xs.set_global_mesh(out)
    return out


def batch_spec(mesh: Any, t: torch.Tensor) -> tuple[Any, ...]:
    """Dim 0 over every data-parallel axis of ``mesh`` (replicas first, then shards), the rest
    replicated: device (r, s) gets rows block r * S + s."""
    axis = (REPLICATE, "fsdp") if REPLICATE in mesh.axis_names else "fsdp"
    return (axis,) + (None,) * (t.dim() - 1)


def wrap(model: nn.Module, plan: WrapPlan, mesh: Any, grad_ckpt: bool, kwargs: dict[str, Any]) -> nn.Module:
    import torch_xla
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    model = to_device_keeping_ties(model, torch_xla.device())
    if plan.tp is not None:
        mark_tensor_parallel(model, plan.tp, mesh)
    return FSDPv2(
        model,
        mesh=mesh,
        shard_output=shard_output,
        auto_wrap_policy=plan_policy(model, plan),
        auto_wrapper_callable=unit_wrapper(FSDPv2, grad_ckpt, fixes=False),
        **kwargs,
    )


def tp_spec(shape: tuple[int, ...], dim: int) -> tuple[Any, ...]:
    """The partition spec of a weight the plan splits along ``dim``: that dim on ``tensor``, the
    largest other one on ``fsdp`` (FSDPv2's own choice of dim); a vector on both, ``tensor`` first,
    so that each tensor-parallel slice is then sharded over ``fsdp`` as a whole."""
    spec: list[Any] = [None] * len(shape)
    rest = [i for i in range(len(shape)) if i != dim]
    if rest:
        spec[dim] = TENSOR
        spec[max(rest, key=lambda i: shape[i])] = "fsdp"
    else:
        spec[dim] = (TENSOR, "fsdp")
    return tuple(spec)


def mark_tensor_parallel(model: nn.Module, tp: TPPlan, mesh: Any) -> None:
    """Mark every weight of ``tp`` with :func:`tp_spec` (a tied weight once, under its first name)."""
    import torch_xla.distributed.spmd as xs

    params = dict(model.named_parameters(remove_duplicate=False))
    done: set[int] = set()
    for name, dim in tp.split_dims().items():
        p = params.get(name)
        if p is None or id(p) in done:
            continue
        done.add(id(p))
        xs.mark_sharding(p, mesh, tp_spec(tuple(p.shape), dim))


def shard_batch(batch: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """The whole global batch on the XLA device, sharded along dim 0 (:func:`batch_spec`)."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    out = {}
    for k, v in batch.items():
        t = v.to(torch_xla.device())
        xs.mark_sharding(t, mesh, batch_spec(mesh, t))
        out[k] = t
    return out


def shard_output(output: Any, mesh: Any) -> None:
    """Shard a forward output along the batch like the inputs (:func:`batch_spec`), as the Trainer's
    FSDPv2 ``shard_output``: a tensor, the first element of a tuple, or a Hugging Face output's
    ``logits`` (``last_hidden_state``); an output without those (TRL's ``FusedCausalLMOutput``, whose
    loss is a scalar and whose per-token fields are ``(batch, sequence)``) by its first field of two
    or more dims."""
    import torch_xla.distributed.spmd as xs

    real = None
    if isinstance(output, torch.Tensor):
        real = output
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        real = output[0]
    elif hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        real = output.logits
    elif hasattr(output, "last_hidden_state") and isinstance(output.last_hidden_state, torch.Tensor):
        real = output.last_hidden_state
    elif isinstance(output, Mapping):
        real = next((v for v in output.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    if real is None:
        raise ShardcoreError(
            f"shardcore xla (xla_fsdp_v2): cannot find the tensor to shard in a {type(output).__name__} "
            "output; return a tensor, a tuple starting with one, or an object with .logits or a batched field."
        )
    xs.mark_sharding(real, mesh, batch_spec(mesh, real))


def like_spmd_param(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` on the XLA device with the same SPMD sharding as ``p``."""
    import torch_xla
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    t = value.to(torch_xla.device(), p.dtype)
    # p's own sharding, not one rebuilt from the global mesh: that mesh may since have been replaced
    # by another model's (another dp_replicate_size in the same process)
    sharding = torch_xla._XLAC._get_xla_op_sharding(p)
    if sharding:
        torch_xla._XLAC._xla_mark_sharding(t, sharding)
    else:
        xs.mark_sharding(t, xs.get_global_mesh(), _prepare_spmd_partition_spec(t, shard_maximal=True))
    return t


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` copied to the CPU, each one whole, the sharded ones put together from their shards.

    torch_xla 2.9's ``.cpu()`` of a tensor split over the devices compiles and runs a program that
    replicates it (``PjRtComputationClient::ReplicateShardedData``), and keeps no cache of it: one
    compilation per tensor at every call. A FULL save of a model with N parameters under AdamW
    compiled 3N programs, every time. Where this process holds every device, each device's shard
    is already addressable, so it is copied as it is and nothing is compiled."""
    import torch_xla

    on_xla = [t for t in tensors if t.device.type == "xla"]
    if on_xla:
        # a value still being computed has no shards yet: one graph computes every such value
        torch_xla._XLAC._xla_sync_multi(on_xla, devices=[], wait=True)
    return [_from_shards(t) if _split_here(t) else _copied(t) for t in tensors]


def _copied(t: torch.Tensor) -> torch.Tensor:
    # .cpu() of an XLA tensor is already a new tensor; of a CPU tensor it is the same one
    return t.detach().cpu() if t.device.type == "xla" else t.detach().clone()


def _split_here(t: torch.Tensor) -> bool:
    """Whether ``t`` is split over the devices, all of them this process's."""
    if t.device.type != "xla":
        return False
    import torch_xla
    import torch_xla.runtime as xr

    spec = torch_xla._XLAC._get_xla_sharding_spec(t)
    return "devices=" in spec and xr.process_count() == 1


def _from_shards(t: torch.Tensor) -> torch.Tensor:
    import torch_xla

    where = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    out = torch.empty(t.shape, dtype=t.dtype)
    # the first replica of each shard; the shards of a dim that does not divide are zero-padded
    first = [i for i, (replica, _) in enumerate(where) if replica == 0]
    regions = [out[tuple(where[i][1])] if where[i][1] is not Ellipsis else out for i in first]
    if sum(r.numel() for r in regions) != out.numel():
        return _copied(t)  # a layout these shards do not cover: torch_xla's own gather
    shards = torch_xla._XLAC._get_local_shards([t])[0]
    for i, region in zip(first, regions):
        data = shards[i][0]
        region.copy_(data[tuple(slice(0, n) for n in region.shape)])
    return out
