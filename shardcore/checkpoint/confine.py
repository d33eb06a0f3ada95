"""Every file a checkpoint names is read from inside its directory.

A checkpoint's own files name other files: the safetensors index's ``weight_map``, DCP's
``.metadata`` (the ``relative_path`` of each storage item), XLA FSDP's ``shards.json``. A name such
as ``../other/secret.safetensors``, an absolute path, or a symlink whose target lies elsewhere would
make "load this checkpoint" read any file the process can read into the model, and from there into
the next checkpoint that is published. :func:`inside` is the one gate every reader goes through.

One layout keeps its files outside the directory on purpose: the Hugging Face hub cache, whose
``<repo>/snapshots/<revision>/`` holds symlinks into ``<repo>/blobs/``. A symlink into that
repository's own ``blobs`` is accepted; nothing else outside is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..errors import CheckpointError


def _roots(root: Path) -> list[Path]:
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        roots.append((real.parent.parent / "blobs").resolve())
    return roots


def inside(root: str | os.PathLike, name: object, what: str) -> Path:
    """``root / name``, after checking that it resolves inside ``root``.

    ``what`` says where the name came from (``"the index's weight_map"``), for the error, which
    names the entry, where it leads, and that nothing was read.
    """
    root = Path(root)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(
            f"shardcore.load: {what} in {str(root)!r} names the file {name!r}, which is not a file name. "
            "The checkpoint is damaged or was not written by a checkpoint writer; nothing was read from it."
        )
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        raise CheckpointError(
            f"shardcore.load: {what} in {str(root)!r} names {name!r}, an absolute path. A checkpoint's files are "
            "read only from inside its directory; nothing was read from it."
        )
    path = root / name
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(
            f"shardcore.load: {what} in {str(root)!r} names {name!r}, which cannot be resolved ({e}); nothing was read."
        ) from None
    if not any(real == r or real.is_relative_to(r) for r in _roots(root)):
        how = "a symlink" if ".." not in PurePosixPath(name).parts else "a path with '..'"
        raise CheckpointError(
            f"shardcore.load: {what} in {str(root)!r} names {name!r}, {how} that leads to {str(real)!r}, outside "
            "the checkpoint directory. A checkpoint's files are read only from inside its directory; nothing was "
            "read from it. Copy the files into the checkpoint directory if they belong to it."
        )
    return path


#: what reading and parsing a JSON file a checkpoint holds may raise: a missing or unreadable file,
#: bytes that are not UTF-8 or not JSON (both ValueErrors), nesting deeper than the parser's recursion
UNREADABLE_JSON = (OSError, ValueError, RecursionError)


def read_json(
    root: str | os.PathLike, name: str, what: str, fix: str = "The checkpoint is damaged; save it again."
) -> Any:
    """The JSON in ``root / name``, read through :func:`inside`; a file that cannot be read or parsed
    is a :class:`CheckpointError` that names it, says why and ends with ``fix``."""
    path = inside(root, name, what)
    try:
        return json.loads(path.read_text())
    except UNREADABLE_JSON as e:
        raise CheckpointError(f"shardcore.load: {str(path)!r} ({what}) is not readable JSON ({e}). {fix}") from None
