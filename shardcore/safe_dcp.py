"""Reading ``torch.distributed.checkpoint`` (DCP) directories without running code from them.

DCP stores its ``.metadata`` as a pickle and reads it with a plain ``pickle.load``; its default load
planner reads every non-tensor entry (optimizer ``param_groups`` values, for one) with
``torch.load(weights_only=False)``. Either lets a checkpoint from a stranger run any command on
load. Here the metadata is unpickled with an allow-list of exactly the classes DCP metadata is made
of, and non-tensor entries with ``torch.load(weights_only=True)``. Anything else is a
:class:`~shardcore.errors.CheckpointError` raised before the object is built.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from .errors import CheckpointError

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    # copyreg's reducer for torch.layout (torch.strided): a lookup in a table of layouts
    "torch.serialization": {"_get_layout"},
    # StorageMeta.checkpoint_id may be a path
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # tensor dtypes (torch.float32): values, not callables
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch.distributed.checkpoint metadata")


def load_metadata(stream: Any, where: str) -> Any:
    """Unpickle DCP metadata from ``stream``, refusing every class outside the allow-list."""
    try:
        return _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"shardcore.load: {where!r} refused: {e}. A DCP .metadata file holds only DCP's own metadata "
            "classes; this one would build something else (possibly running code), so it is not loaded. "
            "Load checkpoints only from sources you trust, or re-save it with shardcore.save."
        ) from None


def check_metadata(metadata: Any, where: str) -> None:
    """The unpickled metadata has DCP's shape: the allow-list decides which classes may be built, not
    what they hold, and DCP indexes into it without checking (a damaged file would fail deep inside a
    load with an ``AttributeError`` or ``KeyError``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"shardcore.load: {where!r} is not torch.distributed.checkpoint metadata: {why}. The checkpoint is "
            "damaged; save it again."
        )

    def sizes(value: Any) -> bool:  # a sequence of non-negative ints
        return isinstance(value, (tuple, list, torch.Size)) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        )

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise bad(f"it holds a {type(metadata).__name__}")
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise bad(f"entry {key!r} is a {type(md).__name__}")
        if isinstance(md, TensorStorageMetadata):
            if not sizes(md.size) or not isinstance(md.chunks, list):
                raise bad(f"entry {key!r} has the size {md.size!r}")
            for chunk in md.chunks:
                if not (sizes(getattr(chunk, "offsets", None)) and sizes(getattr(chunk, "sizes", None))) or not (
                    len(chunk.offsets) == len(chunk.sizes) == len(md.size)
                    and all(o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, md.size))
                ):
                    raise bad(f"entry {key!r} has a chunk outside its size {tuple(md.size)}")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise bad(f"its storage_data is a {type(storage).__name__}")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"a storage_data entry is a {type(info).__name__}")
        if not sizes((info.offset, info.length)):
            raise bad(f"storage item {index.fqn!r} has offset {info.offset!r} and length {info.length!r}")


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose ``read_metadata`` unpickles with the allow-list."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from .checkpoint.confine import inside

            path = self._get_metadata_path(kwargs.get("rank", None))
            inside(self.path, os.path.basename(path), "the DCP metadata")
            with self.fs.create_stream(path, "rb") as f:
                metadata = load_metadata(f, str(path))
            check_metadata(metadata, str(path))
            for info in (metadata.storage_data or {}).values():
                inside(self.path, getattr(info, "relative_path", None), "the DCP metadata's storage_data")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


def reader(path: str) -> Any:
    """A DCP storage reader for ``path`` that runs no code from the checkpoint."""
    return _reader_class()(path)


def load_bytes(value: io.BytesIO) -> Any:
    """A non-tensor DCP entry, read with ``torch.load(weights_only=True)`` (plain Python values and
    tensors only)."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page long; its line naming the refused global is what matters
        why = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
        raise CheckpointError(
            f"shardcore.load: a non-tensor entry of the checkpoint was refused ({why}). It would build an object "
            "that is not a plain value or tensor, possibly running code; load checkpoints only from sources you trust."
        ) from None


def load(state: dict[str, Any], path: str, load_planner: Any = None) -> None:
    """``torch.distributed.checkpoint.load`` of ``path`` into ``state`` through :func:`reader` and a
    safe planner (default :func:`planner`). A :class:`CheckpointError` raised on a rank inside DCP
    comes out as itself, not wrapped in DCP's ``CheckpointException``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader(path), planner=load_planner if load_planner is not None else planner())
    except CheckpointException as e:
        # DCP's own error is a BaseException (an ``except Exception`` in a training loop misses it)
        # that every rank raises with every rank's failure; ours, where a rank raised one, says most
        ours = next((exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)), None)
        if ours is not None:
            raise ours from None
        failures = "; ".join(
            f"rank {r}: {type(exc).__name__}: {exc}"[:300] for r, (exc, _) in sorted(e.failures.items())
        )
        raise CheckpointError(
            f"shardcore.load: reading the torch.distributed.checkpoint files in {path!r} failed ({failures}). "
            "The checkpoint is damaged, or is not one for this model; save it again."
        ) from None


def planner() -> Any:
    """DCP's default load planner, with non-tensor entries read by :func:`load_bytes`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = load_bytes(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
