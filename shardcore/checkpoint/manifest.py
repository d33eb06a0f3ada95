"""``shardcore.json``: what makes a directory a shardcore checkpoint.

It is written last, so a directory that has one is complete; ``save`` overwrites only directories
that have one; and ``load`` learns the format from it instead of guessing from the files. The
version lets an older shardcore refuse a newer layout instead of misreading it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..backend import World
from ..errors import CheckpointError
from .confine import read_json
from .keys import tied_names

MANIFEST = "shardcore.json"
FORMAT_VERSION = 1


def build_manifest(model: nn.Module, kind: str, world: World, runtime: Any, has_optimizer: bool) -> dict[str, Any]:
    return {
        "format": "shardcore",
        "version": FORMAT_VERSION,
        "state_dict_type": kind,
        "world_size": world.size,
        "backend": runtime.name,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "optimizer": has_optimizer,
        "tied": tied_names(model),
        "torch": torch.__version__,
    }


def write_manifest(tmp: Path, manifest: dict[str, Any]) -> None:
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(src: Path) -> dict[str, Any]:
    """The manifest in ``src``, or ``{}`` where there is none (a file, or a save_pretrained directory)."""
    if not src.is_dir():
        return {}
    m = src / MANIFEST
    if not m.is_file():
        return {}
    data = read_json(src, MANIFEST, "the manifest")
    if not isinstance(data, dict) or data.get("format") != "shardcore":
        raise CheckpointError(
            f"shardcore.load: {str(m)!r} is not a shardcore manifest. Remove it or pass another path."
        )
    version = data.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(
            f"shardcore.load: {str(m)!r} has the format version {version!r}, not a version shardcore wrote. "
            "The checkpoint is damaged; save it again."
        )
    kind = data.get("state_dict_type")
    if kind not in (None, "FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        raise CheckpointError(
            f"shardcore.load: {str(m)!r} has state_dict_type {kind!r}; shardcore writes FULL_STATE_DICT or "
            "SHARDED_STATE_DICT. The checkpoint is damaged; save it again."
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"shardcore.load: {str(src)!r} has checkpoint format version {data.get('version')}, newer than this "
            f"shardcore reads ({FORMAT_VERSION}). Upgrade shardcore."
        )
    return data


def is_checkpoint(p: Path) -> bool:
    return p.is_dir() and (p / MANIFEST).is_file()
