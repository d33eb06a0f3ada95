"""A FULL checkpoint gathered in the background (``AsyncFullCheckpoints``).

A synchronous FULL save gathers every parameter and optimizer state to rank 0 while training
waits (``get_model_state_dict(full_state_dict=True)``): most of its time. Here each rank only
copies its own shards into CPU memory, as DCP's ``async_save`` stages a SHARDED checkpoint, and a
thread gathers them to rank 0 afterwards, over a process group of its own. What rank 0 gets is
what ``full_state_dict`` and ``full_optimizer_state_dict`` return: the same keys, the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _Shard:
    """A DTensor's local piece, copied, and where it lies in the whole tensor."""

    __slots__ = ("local", "offsets", "shape", "dtype")

    def __init__(self, local: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype):
        self.local, self.offsets, self.shape, self.dtype = local, offsets, shape, dtype


class Staging:
    """This rank's copies of its state in CPU memory, kept from one background save to the next.

    A save copies into the buffers of the one before (the manager finishes a save before it stages
    the next): memory that is already mapped copies about 2.5 times as fast as fresh memory here,
    and the copy is all the training loop waits for. DCP's ``cache_staged_state_dict`` keeps its
    copies the same way, but pins them, which needs CUDA. The price: the staging memory stays
    held between saves (``shardcore plan`` prints its size)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._next: dict[tuple, torch.Tensor] = {}

    def copy(self, obj: Any, shards: bool) -> Any:
        """``obj`` with every tensor copied into a buffer: each DTensor as a :class:`_Shard`
        (``shards``) or as a DTensor over the copy of its local tensor (what DCP writes)."""
        self._next = {}
        try:
            return self._copy(obj, (), shards)
        finally:
            self._buffers, self._next = self._next, {}

    def _buffer(self, path: tuple, t: torch.Tensor) -> torch.Tensor:
        key = (path, t.dtype, tuple(t.shape))
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        buf.copy_(t.detach())
        self._next[key] = buf
        return buf

    def _copy(self, obj: Any, path: tuple, shards: bool) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            local = self._buffer(path, obj.to_local())
            if shards:
                (chunk,) = obj.__create_chunk_list__()  # the piece this rank holds (DCP plans with the same)
                return _Shard(local, tuple(chunk.offsets), tuple(obj.shape), obj.dtype)
            return DTensor.from_local(
                local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        if isinstance(obj, torch.Tensor):
            return self._buffer(path, obj)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), shards) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i), shards) for i, v in enumerate(obj))
        return obj


class Stager:
    """DCP's ``AsyncStager``: staging is :class:`Staging`'s copy, done before ``async_save`` returns."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def __init__(self, staging: Staging) -> None:
        self.staging = staging

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.staging.copy(state_dict, shards=False)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The DCP layout: ``{"model": ..., "optimizer": ...}`` keyed by original parameter names, sharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        out["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return out


def take(model: nn.Module, optimizer: Any, staging: Staging) -> dict[str, Any]:
    """This rank's sharded state of the model and the optimizer, copied into CPU memory."""
    return staging.copy({"optimizer": None, **state(model, optimizer)}, shards=True)


def gather(snapshot: dict[str, Any], group: Any, rank: int, world: int) -> tuple[dict[str, Any], Any]:
    """The whole state on rank 0, ``(model state, optimizer state or None)``; ``({}, None)`` on the
    others. Collective over ``group``: every rank calls it, in the same order."""
    shards: list[_Shard] = []
    _collect(snapshot, shards)
    # where every rank's piece of every tensor lies: pieces differ in size (uneven rows, HSDP)
    places = [(s.offsets, tuple(s.local.shape)) for s in shards]
    every = [places]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, places, group=group)
    wholes: dict[int, torch.Tensor] = {}
    for i, s in enumerate(shards):
        # as bytes, so that any dtype travels over gloo
        sizes = [math.prod(every[r][i][1]) * s.local.element_size() for r in range(world)]
        mine = s.local.contiguous().reshape(-1).view(torch.uint8)
        pieces = [mine]
        if world > 1:
            padded = torch.zeros(max(sizes), dtype=torch.uint8)
            padded[: mine.numel()] = mine
            pieces = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
            dist.gather(padded, pieces, dst=dist.get_global_rank(group, 0), group=group)
        s.local = None  # this rank's copy is no longer needed
        if rank != 0:
            continue
        whole = torch.empty(s.shape, dtype=s.dtype)
        for r in range(world):
            offsets, shape = every[r][i]
            if sizes[r] == 0:
                continue
            where = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
            whole[where] = pieces[r][: sizes[r]].view(s.dtype).view(shape)
        wholes[id(s)] = whole
    if rank != 0:
        return {}, None
    full = _rebuilt(snapshot, wholes)
    return full["model"], full["optimizer"]


def _collect(obj: Any, out: list[_Shard]) -> None:
    if isinstance(obj, _Shard):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)


def _rebuilt(obj: Any, wholes: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, _Shard):
        return wholes[id(obj)]
    if isinstance(obj, dict):
        return {k: _rebuilt(v, wholes) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuilt(v, wholes) for v in obj)
    return obj
