"""Replacing a checkpoint directory in one step.

A save is written into a temporary sibling and renamed into place only once it is complete, so a
process that dies in the middle of a save (preempted, out of disk, killed) leaves the previous
checkpoint as it was; training resumes from the last good step instead of from a half-written one.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from ..errors import CheckpointError
from .manifest import MANIFEST, is_checkpoint

log = logging.getLogger(__name__)

TMP_TAG = ".shardcore-tmp-"
_OLD_TAG = ".shardcore-old"


def prepare_destination(final: Path, marker: str = MANIFEST) -> Path:
    """Check that ``final`` may be written (it is absent, empty, or holds ``marker``: a save of ours),
    and make the temporary sibling the save goes into."""
    if final.is_symlink():
        raise CheckpointError(
            f"shardcore.save: {str(final)!r} is a symlink (to {os.readlink(final)!r}); a save replaces its "
            "directory as a whole and never writes through a link. Pass the directory it points to, or a new path."
        )
    if final.exists():
        if final.is_dir():
            if not (final / marker).is_file() and any(final.iterdir()):
                raise CheckpointError(
                    f"shardcore.save: {str(final)!r} is a directory that is not a shardcore checkpoint (no "
                    f"{marker}); refusing to overwrite it. Pass a new path or remove the directory."
                )
        else:
            raise CheckpointError(
                f"shardcore.save: {str(final)!r} exists and is not a directory; refusing to overwrite it. "
                "Pass a new directory path."
            )
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}{TMP_TAG}{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(
            f"shardcore.save: cannot create a directory beside {str(final)!r} ({e}). Check the path and its permissions."
        ) from e
    return tmp


def fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` to ``final``; an old checkpoint there is swapped out, then deleted."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.rglob("*"):
        if f.is_file() and not f.is_symlink():  # chmod follows a symlink; the save owns only its own files
            f.chmod(0o666 & ~umask)  # safetensors writes 0600 files; a checkpoint is meant to be shared
            fsync(f)
    fsync(tmp)
    if not final.exists():
        os.rename(tmp, final)
    elif not _exchange(tmp, final):
        # No atomic exchange here: move the old one aside first. Between the two renames only the
        # backup exists, and load() falls back to it.
        old = final.parent / f".{final.name}{_OLD_TAG}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        tmp = old
    fsync(final.parent)
    shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint (or nothing)
    for stale in final.parent.glob(f".{final.name}{TMP_TAG}*"):  # left by saves that were killed
        shutil.rmtree(stale, ignore_errors=True)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform or file system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path``, or the copy :func:`commit` moved aside if a save died between its two renames."""
    p = Path(path)
    if not p.exists():
        old = p.parent / f".{p.name}{_OLD_TAG}"
        if is_checkpoint(old):
            log.warning("shardcore: %s is missing but %s exists (a save was interrupted); loading it", p, old)
            return old
        raise CheckpointError(
            f"shardcore.load: {str(p)!r} does not exist. Pass the directory shardcore.save() or save_pretrained() wrote."
        )
    return p
