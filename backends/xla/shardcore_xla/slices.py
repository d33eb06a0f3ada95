"""Sliced reading of FULL checkpoints (``SlicedLoading``): each rank reads only what its shards hold.

An XLA FSDP shard is the rank's range of the flattened, zero-padded concatenation of one or more
original parameters (:func:`state_dict.fsdp_shard`), so a rank reads, of each original tensor, the
rows that overlap its range. Under SPMD one process drives every device and the range is the whole
tensor; torch_xla then places each device's part. Loaded tensors replace the parameters' data as
device data, so nothing is left pending in the lazy graph.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from . import sharded
from .collectives import Ranks
from .state_dict import param_layout, persistent_buffers, reshard

Fill = Callable[[str, tuple[slice, ...], torch.Tensor], None]


def read_range(
    pieces: list[tuple[str, tuple[int, ...]]], start: int, n: int, dtype: torch.dtype, fill: Fill
) -> torch.Tensor:
    """Elements ``[start, start + n)`` of the concatenation of the flattened ``pieces`` (name, shape),
    zeros past its end, reading of each piece only the rows that overlap."""
    out = torch.zeros(n, dtype=dtype)
    at = 0
    for name, shape in pieces:
        size = math.prod(shape)
        lo, hi = max(at, start), min(at + size, start + n)
        if lo < hi:
            if not shape:
                part = torch.empty((), dtype=dtype)
                fill(name, (), part)
                out[lo - start] = part
            else:
                row = math.prod(shape[1:])
                first, last = (lo - at) // row, -(-(hi - at) // row)
                rows = torch.empty((last - first, *shape[1:]), dtype=dtype)
                fill(name, (slice(first, last), *(slice(0, d) for d in shape[1:])), rows)
                skip = lo - at - first * row
                out[lo - start : hi - start] = rows.reshape(-1)[skip : skip + hi - lo]
        at += size
    return out


def _own_range(p: torch.Tensor, ranks: Ranks) -> tuple[int, int]:
    """(start, length) of this rank's shard in the flattened, padded full parameter."""
    if ranks.spmd:
        return 0, p.numel()
    return ranks.rank() * p.numel(), p.numel()


def load_full_slices(model: nn.Module, fill: Fill, ranks: Ranks) -> None:
    layout = param_layout(model)
    with torch.no_grad():
        for p in model.parameters():
            start, n = _own_range(p, ranks)
            flat = read_range(layout[id(p)], start, n, p.dtype, fill)
            p.data = _placed(p, flat, ranks)
        for name, b in persistent_buffers(model).items():
            value = torch.empty(b.shape, dtype=b.dtype)
            fill(name, tuple(slice(0, d) for d in b.shape), value)
            b.data = value.to(b.device)


def _placed(p: torch.Tensor, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """This rank's shard (``flat``, already cut to it) laid out like ``p`` on its device."""
    if ranks.spmd:
        return reshard(p, flat, ranks)
    return flat.view(p.shape).to(p.device)


def read_optimizer_slices(model: nn.Module, osd: dict[str, Any], fill: Fill, ranks: Ranks) -> dict[str, Any]:
    """Per parameter (by its first piece's name): state shaped like it read as this rank's range,
    the rest (``step``) whole. The layout of ``state_dict.full_optimizer_state_dict``."""
    from shardcore.checkpoint.full import TensorRef

    saved = osd.get("state", {})
    layout = param_layout(model)
    state: dict[str, dict[str, Any]] = {}
    for p in model.parameters():
        pieces = layout[id(p)]
        if pieces[0][0] not in saved:
            continue
        start, n = _own_range(p, ranks)
        st: dict[str, Any] = {}
        for k, v in saved[pieces[0][0]].items():
            if isinstance(v, TensorRef) and v.shape:
                refs = [(saved[name][k].key, shape) for name, shape in pieces]
                st[k] = read_range(refs, start, n, v.dtype, fill)
            elif isinstance(v, TensorRef):
                st[k] = torch.empty((), dtype=v.dtype)
                fill(v.key, (), st[k])
            else:
                st[k] = v
        state[pieces[0][0]] = st
    return {"state": state, "param_groups": osd.get("param_groups", [])}


def load_optimizer_slices(model: nn.Module, optimizer: Any, part: dict[str, Any], ranks: Ranks) -> None:
    layout = param_layout(model)
    sharded.restore_param_groups(optimizer, part.get("param_groups", []), "the checkpoint")
    new_state: dict[Any, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = part["state"].get(layout[id(p)][0][0])
            if st is None:
                continue
            new_state[p] = {
                k: _placed(p, v, ranks) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in st.items()
            }
    optimizer.state.clear()
    optimizer.state.update(new_state)
