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


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose ``read_metadata`` unpickles with the allow-list."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank", None))
            with self.fs.create_stream(path, "rb") as f:
                metadata = load_metadata(f, str(path))
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
        ours = next((exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)), None)
        if ours is not None:
            raise ours from None
        raise


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
