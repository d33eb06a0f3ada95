"""Models built without weights, sharded as empty shards, filled by a sliced load.

The flow that keeps every rank's memory at its own shard (``shardcore.from_pretrained`` with
``cpu_ram_efficient_loading`` on a backend with :class:`~shardcore.capabilities.SlicedLoading`)::

    with shardcore.init_empty_weights():        # parameters on meta, buffers real
        model = build(config)                   # on every rank
    model = shardcore.shard(model, {"cpu_ram_efficient_loading": True})   # empty shards
    shardcore.load(model, "checkpoint_dir")     # each rank reads only its slices

Until the load, a forward raises :class:`CheckpointError`: training on uninitialized memory would
otherwise fail silently, with plausible losses.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from .errors import CheckpointError
from .ties import retie, tie_groups

_AWAITING = "_shardcore_awaiting_weights"


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real, as
    accelerate's ``init_empty_weights()`` does by default.

    Buffers stay real because a checkpoint does not hold the non-persistent ones (rotary
    ``inv_freq``): the model computes them itself, and they are small. A parameter is created
    where its module creates it (``torch.empty``, whose pages are never touched) and moved to meta
    at once, so no rank ever holds the weights."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            extra = dict(param.__dict__)
            extra["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **extra)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that no state dict (and so no checkpoint) holds, by name."""
    out = {}
    for prefix, mod in model.named_modules():
        for name in sorted(mod._non_persistent_buffers_set):
            buf = mod._buffers.get(name)
            if buf is not None:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def weights_state(model: nn.Module) -> str:
    """``"real"`` (no tensor on meta), ``"empty"`` (every parameter on meta and every buffer a
    checkpoint cannot fill real: what :func:`init_empty_weights` builds), or ``"partial"``."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return "real"
    params = list(model.parameters())
    if params and all(p.is_meta for p in params) and not any(b.is_meta for b in non_persistent_buffers(model).values()):
        return "empty"
    return "partial"


def materialize_empty(model: nn.Module, device: torch.device | str) -> None:
    """Allocate (uninitialized) every meta tensor of a sharded model on ``device``, in its sharded
    size; real buffers keep their values and tied parameters stay tied (``to_empty`` loses both)."""
    keep = {
        (id(mod), name): buf
        for mod in model.modules()
        for name, buf in mod._buffers.items()
        if buf is not None and not buf.is_meta
    }
    groups = tie_groups(model)
    model.to_empty(device=device)
    for mod in model.modules():
        for name in list(mod._buffers):
            old = keep.get((id(mod), name))
            if old is not None:
                mod._buffers[name] = old.to(device)
    retie(groups)


def await_weights(model: nn.Module) -> None:
    """Refuse a forward of ``model`` until :func:`weights_arrived` (a load) is called."""

    def refuse(module: nn.Module, args: Any) -> None:
        raise CheckpointError(
            f"shardcore: this {type(module).__name__} was sharded from a model without weights (parameters on the "
            "meta device under cpu_ram_efficient_loading), so its shards are uninitialized memory. Call "
            "shardcore.load(model, path) on every rank before the first forward (shardcore.from_pretrained does)."
        )

    object.__setattr__(model, _AWAITING, model.register_forward_pre_hook(refuse))


def weights_arrived(model: nn.Module) -> None:
    """The model's weights were loaded: forwards may run."""
    hook = model.__dict__.pop(_AWAITING, None)
    if hook is not None:
        hook.remove()


def awaiting_weights(model: nn.Module) -> bool:
    return _AWAITING in model.__dict__
