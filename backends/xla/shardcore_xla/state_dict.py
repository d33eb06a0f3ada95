"""FULL state dicts and optimizer state of a sharded XLA model: one unsharded state dict with the
unwrapped model's parameter names, on CPU, the format every shardcore backend writes (a checkpoint
moves between backends), and back into the shards.

Under SPMD a parameter is one global tensor. Under XLA FSDP each rank holds a flat, padded shard of
one parameter, or with ``flatten_parameters`` of several (:func:`param_layout`), and the unwrapped
names are the wrapped ones without the wrappers' path segments (:func:`strip_wrappers`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from shardcore.errors import CheckpointError

from . import sharded
from .collectives import Ranks
from .spmd import like_spmd_param, to_host

#: parameter id -> the (name in the unwrapped model, shape) pieces it holds, in order
Layout = dict[int, list[tuple[str, tuple[int, ...]]]]


def strip_wrappers(key: str) -> str:
    for w in ("_orig_module.", "_fsdp_wrapped_module.", "_fpw_module.", "_xla_checkpointed_module."):
        key = key.replace(w, "")
    return key


def param_layout(model: nn.Module) -> Layout:
    """Parameter id -> the (name in the unwrapped model, shape) pieces it holds, in order.

    Under SPMD a parameter is one whole tensor. Under XLA FSDP it is a flat, padded shard of one
    parameter (``_orig_name``, ``_orig_size``), or with ``flatten_parameters`` of several, listed
    in the root's ``get_shard_metadata()["flatten_info"]``."""
    flatten_info = {}
    if hasattr(model, "get_shard_metadata"):
        flatten_info = model.get_shard_metadata().get("flatten_info", {})
    out: Layout = {}
    for prefix, mod in model.named_modules():
        for local, p in mod.named_parameters(recurse=False):
            orig = getattr(p, "_orig_name", None)
            if orig is None:
                out[id(p)] = [(strip_wrappers(f"{prefix}.{local}" if prefix else local), tuple(p.shape))]
                continue
            full = f"{prefix}.{orig}" if prefix else orig
            flat_key = full.replace("_fpw_module.", "")
            if flat_key in flatten_info:
                names, shapes, _ = flatten_info[flat_key]
                base = full.rsplit(".", 1)[0]
                out[id(p)] = [(strip_wrappers(f"{base}.{n}"), tuple(sh)) for n, sh in zip(names, shapes)]
            else:
                out[id(p)] = [(strip_wrappers(full), tuple(p._orig_size))]
    return out


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds, by unwrapped name."""
    out = {}
    for prefix, mod in model.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[strip_wrappers(f"{prefix}.{name}" if prefix else name)] = b
    return out


def with_aliases(d: dict[str, Any], aliases: dict[str, str], copy: Callable[[Any], Any]) -> dict[str, Any]:
    """``d`` with each tied weight under each of its names, as in the unwrapped model's state_dict()."""
    # either name of a tied pair may be the one the wrapper kept
    for alias, kept in aliases.items():
        if kept in d and alias not in d:
            d[alias] = copy(d[kept])
        elif alias in d and kept not in d:
            d[kept] = copy(d[alias])
    return d


# ---------------------------------------------------------------- model


def full_state_dict(model: nn.Module, ranks: Ranks) -> dict[str, Any]:
    if ranks.spmd:
        sd = model.state_dict()
        return {strip_wrappers(k): v for k, v in zip(sd, to_host(list(sd.values())))}
    return consolidate_fsdp(model, ranks)


def consolidate_fsdp(model: nn.Module, ranks: Ranks) -> dict[str, Any]:
    """Gather every rank's shards (``all_gather``) and rebuild full tensors with torch_xla's own
    ``consolidate_sharded_state_dicts``, so the names and shapes are exactly the unwrapped model's."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    sd = model.state_dict()
    meta = model.get_shard_metadata()
    world = ranks.size()
    if world == 1:
        per_rank = [{k: v.cpu() for k, v in sd.items()}]
    elif ranks.threads is not None:
        ranks.threads.sync()
        per_rank = ranks.threads.exchange(ranks.rank(), {k: v.detach().cpu() for k, v in sd.items()})
    else:
        gathered = {k: xm.all_gather(v.unsqueeze(0), dim=0) for k, v in sd.items()}
        torch_xla.sync()
        per_rank = [{k: g[r].cpu() for k, g in gathered.items()} for r in range(world)]
    full = consolidate_sharded_state_dicts(per_rank, meta)
    return {strip_wrappers(k): v.detach().cpu().clone() for k, v in full.items()}


def full_state_dict_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The keys and shapes :func:`full_state_dict` returns, without gathering anything."""
    shapes = {n: sh for pieces in param_layout(model).values() for n, sh in pieces}
    shapes.update({k: tuple(b.shape) for k, b in persistent_buffers(model).items()})
    return shapes


def rank0_weights(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """``cpu_ram_efficient_loading``, before wrapping: rank 0's parameters and buffers (every buffer:
    the other ranks' meta ones have no value), by name, for :func:`load_full_state_dict` to fill the
    shards with; ``{}`` on the other ranks. ``validate_model`` has checked rank 0's model
    (``shardcore.validate.check_rank0_weights``)."""
    if rank != 0:
        return {}
    tensors = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    return {strip_wrappers(k): t.detach() for k, t in tensors.items()}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any], ranks: Ranks) -> None:
    """Put an unsharded state dict (read on rank 0 only) into the sharded model, each rank taking
    its shard the way the wrapper laid it out. Collective."""
    sd = ranks.broadcast_tensors(state_dict)
    layout = param_layout(model)
    missing = [n for p in model.parameters() for n, _ in layout[id(p)] if n not in sd]
    if missing:  # every rank has the same sd: every rank raises
        raise CheckpointError(
            f"shardcore.load: the state dict lacks {missing[:5]} (and {max(0, len(missing) - 5)} more)."
        )
    with torch.no_grad():
        for p in model.parameters():
            flat = torch.cat([sd[n].detach().reshape(-1).to(p.dtype) for n, _ in layout[id(p)]])
            if ranks.spmd:
                p.data = reshard(p, flat, ranks)  # a fresh tensor carrying the sharding annotation
            else:
                p.copy_(reshard(p, flat, ranks))
        for bname, b in model.named_buffers():
            key = strip_wrappers(bname)
            if key in sd:
                b.copy_(sd[key].to(b.device, b.dtype))


# ---------------------------------------------------------------- optimizer


def full_optimizer_state_dict(model: nn.Module, optimizer: Any, ranks: Ranks) -> dict[str, Any]:
    """``optimizer``'s state unsharded and keyed by parameter name (the layout of
    ``get_optimizer_state_dict(full_state_dict=True)``), on CPU."""
    layout = param_layout(model)
    state: dict[str, Any] = {}
    for p, st in optimizer.state.items():
        pieces = layout[id(p)]
        per_piece: list[dict[str, Any]] = [{} for _ in pieces]
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                for d, t in zip(per_piece, unshard(v, pieces, ranks)):
                    d[k] = t
            else:
                for d in per_piece:
                    d[k] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
        for (name, _), d in zip(pieces, per_piece):
            state[name] = d
    return {
        "state": state,
        "param_groups": sharded.named_param_groups(optimizer, lambda p: [n for n, _ in layout[id(p)]]),
    }


def load_full_optimizer_state_dict(model: nn.Module, optimizer: Any, state: dict[str, Any], ranks: Ranks) -> None:
    """Rank 0's ``state`` (:func:`full_optimizer_state_dict`'s layout) into ``optimizer``, each rank
    taking its shards. Collective."""
    state = ranks.broadcast_object(state)
    layout = param_layout(model)
    saved_state = state.get("state", {})
    sharded.restore_param_groups(optimizer, state.get("param_groups", []), "the checkpoint")
    new_state: dict[Any, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            pieces = layout[id(p)]
            if pieces[0][0] not in saved_state:
                continue
            first = saved_state[pieces[0][0]]
            st = {}
            for k, v in first.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    flat = torch.cat([saved_state[n][k].reshape(-1) for n, _ in pieces])
                    st[k] = reshard(p, flat, ranks)
                else:
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else v
            new_state[p] = st
    optimizer.state.clear()
    optimizer.state.update(new_state)


# ---------------------------------------------------------------- shards


def unshard(v: torch.Tensor, pieces: list[tuple[str, tuple[int, ...]]], ranks: Ranks) -> list[torch.Tensor]:
    """A tensor laid out like the parameter holding ``pieces`` (its optimizer state) as unsharded
    CPU pieces. Collective under XLA FSDP."""
    flat = (to_host([v])[0] if ranks.spmd else ranks.all_gather_dim0(v).detach().cpu()).reshape(-1)
    out, at = [], 0
    for _, shape in pieces:
        n = math.prod(shape)
        out.append(flat[at : at + n].view(shape).clone())
        at += n
    return out


def reshard(p: torch.Tensor, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The inverse of :func:`unshard`: CPU values laid out like parameter ``p``, on its device."""
    if ranks.spmd:
        return like_spmd_param(p, flat.view(p.shape))
    return fsdp_shard(flat, p, ranks.rank(), ranks.size()).to(p.device, flat.dtype)


def fsdp_shard(full: torch.Tensor, like: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` laid out like the XLA FSDP shard ``like``: flattened and
    zero-padded to ``world * like.numel()`` then cut in ``world`` chunks (the default), or, with
    ``shard_param_on_dim_0``, padded along dim 0 to ``world * like.shape[0]`` rows and cut there."""
    if like.dim() <= 1 and (full.dim() <= 1 or like.shape[0] != full.shape[0] * world):
        flat = full.detach().reshape(-1)
        n = like.numel()
        padded = torch.zeros(world * n, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        return padded[rank * n : (rank + 1) * n].clone()
    full = full.detach().reshape((-1,) + tuple(like.shape[1:]))
    rows = like.shape[0]
    padded = torch.zeros((world * rows,) + tuple(like.shape[1:]), dtype=full.dtype)
    padded[: full.shape[0]] = full
    return padded[rank * rows : (rank + 1) * rows].clone()
