"""SHARDED_STATE_DICT checkpoints of the XLA backend, in its two modes.

SPMD (``xla_fsdp_v2: true``)
    ``torch.distributed.checkpoint`` with torch_xla's ``SPMDSavePlanner`` / ``SPMDLoadPlanner``: each
    device's shards of the global tensors are written and read in place, keyed ``model.<name>`` and
    ``optimizer.state.<name>.<key>`` with the unwrapped names, so a run on any number of devices
    reads it (DCP reshards). Optimizer hyperparameters go to ``optimizer_groups.json``.

XLA FSDP (``xla_fsdp_v2: false``)
    Every rank writes its own shards, ``rank-<r>-of-<w>.safetensors`` (each parameter's flat, padded
    shard and its optimizer state, keyed by the first unwrapped name the parameter holds), and
    rank 0 writes ``shards.json``: the world size, which unwrapped (name, shape) pieces each shard
    holds, every key's global shape, the buffers and the optimizer's non-tensor state. That is
    torch_xla's own "shard plus shard metadata" layout (``get_shard_metadata``), without pickle.
    Loading at any world size: rank 0 concatenates the saved ranks' shards into full tensors and
    every rank takes its part, as a FULL load does.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from shardcore import safe_dcp
from shardcore.checkpoint.confine import inside, read_json
from shardcore.errors import CheckpointError

INDEX = "shards.json"
GROUPS = "optimizer_groups.json"
FORMAT = "shardcore-xla-fsdp-shards"


def _rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def check_mode(path: str, spmd: bool) -> None:
    """A sharded checkpoint loads only into the XLA mode that wrote it: SPMD's is a
    torch.distributed.checkpoint directory, XLA FSDP's is not. Every rank checks, so every rank raises."""
    dcp = os.path.isfile(os.path.join(path, ".metadata"))
    if spmd and not dcp:
        raise CheckpointError(
            f"shardcore.load: {path!r} is not a torch.distributed.checkpoint directory, so not a sharded checkpoint "
            "of SPMD (xla_fsdp_v2: true). A sharded checkpoint loads only into the XLA mode that wrote it; save "
            "FULL_STATE_DICT to move between modes."
        )
    if not spmd and dcp:
        raise CheckpointError(
            f"shardcore.load: {path!r} is a torch.distributed.checkpoint directory (FSDP2 or SPMD), not XLA FSDP's "
            "per-rank shards. A sharded checkpoint loads only into the backend and mode that wrote it; save "
            "FULL_STATE_DICT to move between them."
        )


# ------------------------------------------------------------------------------------ SPMD (DCP)


def spmd_state(model: nn.Module, optimizer: Any, strip: Callable[[str], str], prime: bool) -> dict[str, Any]:
    """The DCP state dict of an SPMD model: its (sharded, on-device) tensors under unwrapped names.
    ``prime``: give an optimizer that has not stepped yet its state, so DCP can load into it."""
    state = {f"model.{strip(k)}": v for k, v in model.state_dict().items()}
    if optimizer is None:
        return state
    names = {id(p): strip(n) for n, p in model.named_parameters()}
    if prime and not optimizer.state:
        _prime(optimizer)
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                state[f"optimizer.state.{names[id(p)]}.{k}"] = v
    return state


def _prime(optimizer: Any) -> None:
    from torch_xla.experimental.distributed_checkpoint.util import prime_optimizer

    prime_optimizer(optimizer)  # a zero-gradient step creates the state; the load overwrites it


def save_spmd(model: nn.Module, optimizer: Any, path: str, strip: Callable[[str], str]) -> None:
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class OneCopySPMDSavePlanner(SPMDSavePlanner):
        """Each chunk written once. Under HSDP a parameter is sharded over ``fsdp`` and replicated over
        ``replicate``, so this one process holds each shard once per replica, as write items with the
        same fqn and offsets. torch_xla 2.9's ``dedup_tensors`` keys them by ``MetadataIndex``, whose
        equality ignores the shard index, and with a single plan it drops the copies it finds in
        plan 0 "after the first", which is plan 0 itself: every copy goes and nothing is written."""

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            seen, items = set(), []
            for item in plan.items:
                if item.index not in seen:
                    seen.add(item.index)
                    items.append(item)
            return dataclasses.replace(plan, items=items)

    dcp.save(
        spmd_state(model, optimizer, strip, prime=False),
        storage_writer=dcp.FileSystemWriter(path),
        planner=OneCopySPMDSavePlanner(),
    )
    if optimizer is not None:
        names = {id(p): strip(n) for n, p in model.named_parameters()}
        Path(path, GROUPS).write_text(json.dumps(named_param_groups(optimizer, lambda p: [names[id(p)]])))


def load_spmd(model: nn.Module, optimizer: Any, path: str, strip: Callable[[str], str]) -> None:
    import torch_xla.core.xla_model as xm
    from torch.distributed.checkpoint._traverse import set_element
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    class SafeSPMDLoadPlanner(SPMDLoadPlanner):
        """Non-tensor entries read with ``torch.load(weights_only=True)``, whatever torch's default."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], safe_dcp.load_bytes(value))

    state = spmd_state(model, optimizer, strip, prime=True)
    # the planner reads each tensor's device data; a torch_xla.sync() still running (the step end
    # before the load, or priming the optimizer) makes it fail now and then with "Trying to access
    # XLA data for tensor ... while an async operation is in flight"
    xm.wait_device_ops()
    safe_dcp.load(state, path, SafeSPMDLoadPlanner())
    if optimizer is not None:
        saved = read_json(path, GROUPS, "the SPMD checkpoint's optimizer groups", "Save it again.")
        restore_param_groups(optimizer, saved, f"the checkpoint at {path!r}")


# ------------------------------------------------------------------------------------ XLA FSDP


def save_fsdp(
    model: nn.Module,
    optimizer: Any,
    path: str,
    rank: int,
    world: int,
    layout: dict[int, list[tuple[str, tuple[int, ...]]]],
    buffers: dict[str, torch.Tensor],
) -> None:
    """Write this rank's shards; rank 0 also writes the index. Not collective by itself."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list] = {}
    opt_meta: dict[str, dict[str, Any]] = {}
    for p in model.parameters():
        first = layout[id(p)][0][0]
        pieces[first] = [[n, list(s)] for n, s in layout[id(p)]]
        tensors[f"model.{first}"] = p.detach().cpu().reshape(-1).contiguous()
        if optimizer is not None and p in optimizer.state:
            for k, v in optimizer.state[p].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    tensors[f"optimizer.{first}.{k}"] = v.detach().cpu().reshape(-1).contiguous()
                else:  # a scalar such as Adam's step: [value, whether it was a tensor]
                    opt_meta.setdefault(first, {})[k] = [v.item(), True] if isinstance(v, torch.Tensor) else [v, False]
    save_file(tensors, str(Path(path, _rank_file(rank, world))))
    if rank != 0:
        return
    index = {
        "format": FORMAT,
        "world_size": world,
        "pieces": pieces,
        "keys": {n: list(s) for ps in layout.values() for n, s in ps} | {n: list(b.shape) for n, b in buffers.items()},
        "optimizer": optimizer is not None,
        "optimizer_scalars": opt_meta,
    }
    if buffers:
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in buffers.items()}, str(Path(path, "buffers.safetensors"))
        )
    if optimizer is not None:
        index["param_groups"] = named_param_groups(optimizer, lambda p: [n for n, _ in layout[id(p)]])
    Path(path, INDEX).write_text(json.dumps(index))


def read_fsdp(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The full (unsharded) model state dict and optimizer state (the layout of the backend's
    ``full_optimizer_state_dict``) of an XLA FSDP sharded checkpoint of any world size.

    The index and the shards come from a file that may have been damaged or written by someone
    else: anything that does not fit together is a :class:`CheckpointError` naming the file."""
    index = read_index(path)
    try:
        return _read_fsdp(path, index)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors, torch.cat, view: each raises its own type
        raise CheckpointError(
            f"shardcore.load: the XLA FSDP shards in {path!r} do not fit their {INDEX} ({type(e).__name__}: {e}). "
            "The checkpoint is damaged; save it again."
        ) from None


def _read_fsdp(path: str, index: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    from safetensors.torch import load_file

    world = index["world_size"]
    ranks = [load_file(str(inside(path, _rank_file(r, world), INDEX))) for r in range(world)]
    full: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict[str, Any]] = {}
    for first, pieces in index["pieces"].items():
        for name, t in _split(torch.cat([r[f"model.{first}"] for r in ranks]), pieces).items():
            full[name] = t
        for key in {k.split(".")[-1] for k in ranks[0] if k.startswith(f"optimizer.{first}.")}:
            flat = torch.cat([r[f"optimizer.{first}.{key}"] for r in ranks])
            for name, t in _split(flat, pieces).items():
                opt_state.setdefault(name, {})[key] = t
        for key, (v, was_tensor) in index["optimizer_scalars"].get(first, {}).items():
            for name, _ in pieces:
                opt_state.setdefault(name, {})[key] = torch.tensor(v) if was_tensor else v
    buffers = inside(path, "buffers.safetensors", INDEX)
    if buffers.is_file():
        full.update(load_file(str(buffers)))
    if not index["optimizer"]:
        return full, None
    return full, {"state": opt_state, "param_groups": index["param_groups"]}


def read_index(path: str) -> dict[str, Any]:
    f = Path(path, INDEX)
    index = read_json(
        path,
        INDEX,
        "the XLA FSDP shard index",
        "It is not an XLA FSDP sharded checkpoint (one written with xla_fsdp_v2: false), or it is damaged. Save it "
        "again.",
    )
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"shardcore.load: {str(f)!r} is not an XLA FSDP shard index. Save the checkpoint again.")
    world = index.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= 1 << 20:
        raise CheckpointError(
            f"shardcore.load: {str(f)!r} says world_size {world!r}; a checkpoint of n ranks has 1 <= n files. "
            "The checkpoint is damaged; save it again."
        )
    return index


def _split(flat: torch.Tensor, pieces: list) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, shape in pieces:
        n = math.prod(shape)
        out[name] = flat[at : at + n].view(shape).clone()
        at += n
    return out


def named_param_groups(optimizer: Any, names: Callable[[Any], list[str]]) -> list[dict[str, Any]]:
    """``optimizer.param_groups`` with each parameter replaced by its unwrapped name(s)."""
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [n for p in g["params"] for n in names(p)]}
        for g in optimizer.param_groups
    ]


def restore_param_groups(optimizer: Any, groups: list[dict[str, Any]], source: str) -> None:
    """Set the hyperparameters of :func:`named_param_groups` back (JSON turned tuples into lists)."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(
            f"shardcore.load: {source} has optimizer parameter groups of another shape. Save it again."
        )
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"shardcore.load: {source} has {len(groups)} optimizer parameter groups, this optimizer "
            f"{len(optimizer.param_groups)}. Build the optimizer the way the saving run did."
        )
    for g, saved in zip(optimizer.param_groups, groups):
        odd = [k for k, v in saved.items() if k != "params" and k in g and not _same_kind(g[k], v)]
        if odd:
            raise CheckpointError(
                f"shardcore.load: {source} has optimizer hyperparameters of another type than this optimizer's: "
                f"{', '.join(f'{k}={saved[k]!r}' for k in odd[:3])}. Save it again."
            )
        g.update({k: (tuple(v) if isinstance(g.get(k), tuple) else v) for k, v in saved.items() if k != "params"})


def _same_kind(mine: Any, saved: Any) -> bool:
    """Whether a saved hyperparameter can stand where this optimizer has ``mine`` (JSON has no
    tuples, and writes 1.0 as 1.0 but an int learning rate as 1)."""
    number = (int, float)
    if isinstance(mine, bool) or isinstance(saved, bool):
        return isinstance(mine, bool) == isinstance(saved, bool)
    if isinstance(mine, number):
        return isinstance(saved, number)
    if isinstance(mine, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(mine)
    return mine is None or saved is None or type(mine) is type(saved)
