"""Whether a checkpoint fits a model, decided before any tensor is read.

Loading the wrong checkpoint should fail with the names that differ, not with a shape error deep
inside a backend's collective (or, worse, half a model loaded). Every rank checks the same file
headers, so every rank reaches the same verdict without talking to the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .. import safe_dcp, ties
from ..capabilities import RenamesParameters
from ..errors import CheckpointError
from .confine import read_json
from .runtime import runtime_of

#: the file torch.distributed.checkpoint writes last; its presence marks a DCP directory
DCP_METADATA = ".metadata"

#: the index a backend writes beside its own per-rank shards where torch.distributed.checkpoint
#: cannot be used (XLA FSDP's device threads have no torch.distributed group): JSON with ``keys``
#: (unwrapped name -> global shape) and ``optimizer`` (whether optimizer state is in it)
SHARD_INDEX = "shards.json"


def tied_names(model: nn.Module) -> dict[str, str]:
    """Tied parameters: ``{name that is not stored: name that is}``, as ``save_pretrained`` decides
    (``shardcore.ties.tied_names``). A backend whose wrappers rename parameters answers for its
    models (RenamesParameters)."""
    runtime = runtime_of(model)[0]
    if isinstance(runtime, RenamesParameters):
        return runtime.tied_aliases(model)
    return ties.tied_names(model)


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of ``model`` with its global shape (a sharded tensor reports the whole).

    A backend whose wrappers rename or flatten parameters (XLA FSDP) says it itself
    (RenamesParameters)."""
    runtime = runtime_of(model)[0]
    if isinstance(runtime, RenamesParameters):
        return runtime.full_state_dict_shapes(model)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def check_keys(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
    where: str,
) -> None:
    """Same keys and shapes, or an error that lists the differences. Run on every rank from the same
    file headers, so every rank reaches the same verdict without talking to the others."""
    missing = sorted(k for k in expected if k not in found and aliases.get(k) not in found)
    extra = sorted(k for k in found if k not in expected)
    wrong = sorted(k for k in expected if k in found and tuple(found[k]) != tuple(expected[k]))
    if not (missing or extra or wrong):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if extra:
        parts.append(f"{len(extra)} unexpected (e.g. {', '.join(extra[:3])})")
    if wrong:
        parts.append(
            f"{len(wrong)} with another shape (e.g. {', '.join(f'{k}: checkpoint {tuple(found[k])}, model {tuple(expected[k])}' for k in wrong[:3])})"
        )
    raise CheckpointError(
        f"shardcore.load: {where!r} is a checkpoint of another model: {'; '.join(parts)}. Build the model with the "
        "same class and config that saved it (a Transformers checkpoint carries its config.json)."
    )


def check_sharded(model: nn.Module, src: Path, optimizer: Any) -> None:
    """Check a SHARDED checkpoint against ``model`` from its index: a backend's own shard index, or
    DCP's metadata (read with the allow-listed unpickler, since the file may come from anywhere)."""
    index = src / SHARD_INDEX
    if index.is_file() and not (src / DCP_METADATA).is_file():
        data = read_json(src, SHARD_INDEX, "the shard index", "Save it again.")
        try:
            found, has_optimizer = {k: tuple(v) for k, v in data["keys"].items()}, bool(data["optimizer"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"shardcore.load: {str(index)!r} is not a readable shard index ({e!r}). Save it again."
            ) from None
        _check_found(model, src, optimizer, found, has_optimizer)
        return
    try:
        md = safe_dcp.reader(str(src)).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP raises several types
        raise CheckpointError(
            f"shardcore.load: {str(src)!r} is not a readable torch.distributed.checkpoint directory ({e}). Save it again."
        ) from None
    found: dict[str, tuple[int, ...]] = {}
    has_optimizer = False
    for key, meta in md.state_dict_metadata.items():
        if key.startswith("model."):
            size = getattr(meta, "size", None)
            if size is not None:
                found[key[len("model.") :]] = tuple(size)
        elif key.startswith("optimizer."):
            has_optimizer = True
    _check_found(model, src, optimizer, found, has_optimizer)


def _check_found(
    model: nn.Module, src: Path, optimizer: Any, found: dict[str, tuple[int, ...]], has_optimizer: bool
) -> None:
    check_keys(expected_shapes(model), found, tied_names(model), str(src))
    if optimizer is not None and not has_optimizer:
        raise CheckpointError(
            f"shardcore.load: an optimizer was passed but {str(src)!r} holds no optimizer state. Load without "
            "optimizer=, or save with shardcore.save(model, path, optimizer)."
        )
