"""Filling FSDP2's shards under ``cpu_ram_efficient_loading``: from rank 0's weights (broadcast), or
each rank from its own slices of a checkpoint (``SlicedLoading``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardcore.empty import non_persistent_buffers
from shardcore.ties import retie, tie_groups
from shardcore.validate import layout


def local_index(t: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor this rank holds of ``t``: for a DTensor the rows DTensor assigns it
    (``compute_local_shape_and_global_offset``: FSDP2's dim-0 chunks, under HSDP the same chunks in
    every replica), else all of it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def fill_shards(model: nn.Module, fill: Callable[[str, tuple[slice, ...], torch.Tensor], None]) -> None:
    """Every parameter's local shard (and every persistent buffer, whole) from ``fill``."""
    skip = set(non_persistent_buffers(model))
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n not in skip)]
    with torch.no_grad():
        for name, t in tensors:
            fill(name, local_index(t), t.to_local() if hasattr(t, "to_local") else t)


def read_optimizer_slices(model: nn.Module, osd: dict[str, Any], fill: Callable[..., None]) -> dict[str, Any]:
    """The optimizer state dict in the sharded form ``get_optimizer_state_dict`` gives (FSDP2's
    own): state shaped like its parameter becomes a DTensor over this rank's rows of it, laid out
    as the parameter is; the rest (``step``) is read whole."""
    from torch.distributed.tensor import DTensor

    from shardcore.checkpoint.full import TensorRef

    params = dict(model.named_parameters(remove_duplicate=False))

    def read(ref: TensorRef, p: torch.Tensor) -> torch.Tensor:
        if isinstance(p, DTensor) and tuple(ref.shape) == tuple(p.shape):
            index = local_index(p)
            local = torch.empty([s.stop - s.start for s in index], dtype=ref.dtype, device=p.to_local().device)
            fill(ref.key, index, local)
            return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        whole = torch.empty(ref.shape, dtype=ref.dtype)
        fill(ref.key, tuple(slice(0, n) for n in ref.shape), whole)
        return whole

    state = {
        name: {k: read(v, params[name]) if isinstance(v, TensorRef) else v for k, v in entries.items()}
        for name, entries in osd.get("state", {}).items()
    }
    return {"state": state, "param_groups": osd.get("param_groups", [])}


def take_rank0_weights(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Before sharding with cpu_ram_efficient_loading: keep rank 0's weights aside and move every
    rank's model to the meta device, so that sharding allocates nothing and rank 0's weights can be
    broadcast into the shards afterwards. Returns (rank 0's state dict, its non-persistent buffers);
    both empty on the other ranks, whose model may have been built on the meta device.
    ``validate_model`` has checked that the ranks' models agree."""
    rank = dist.get_rank()
    box = [layout(model)]
    dist.broadcast_object_list(box, src=0)
    rank0_layout = box[0]

    state = model.state_dict() if rank == 0 else {}
    buffers = non_persistent_buffers(model) if rank == 0 else {}
    groups = tie_groups(model)
    model.to(torch.device("meta"))
    # the other ranks take rank 0's dtypes, so that every rank shards the same thing
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for slot in (mod._parameters, mod._buffers):
            for name, t in list(slot.items()):
                want = None if t is None else getattr(torch, rank0_layout[f"{prefix}.{name}" if prefix else name][1])
                if want is not None and t.dtype != want:
                    new = torch.empty_like(t, dtype=want)
                    slot[name] = (
                        nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
                    )
    retie(groups)  # .to() gives each module its own new Parameter
    return state, buffers


def broadcast_buffers(model: nn.Module, rank0_buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Non-persistent buffers (rotary ``inv_freq``...) are in no state dict: send rank 0's to all."""
    for fqn, buf in non_persistent_buffers(model).items():
        if dist.get_rank() == 0:
            t = rank0_buffers[fqn].detach().to(device).contiguous()
        else:
            t = torch.empty(buf.shape, dtype=buf.dtype, device=device)
        dist.broadcast(t, src=0)
        mod_name, _, name = fqn.rpartition(".")
        model.get_submodule(mod_name).register_buffer(name, t, persistent=False)
