"""The FULL format: what ``save_pretrained`` writes, so any PyTorch or Transformers program reads it.

Everything is safetensors or JSON, never pickle, so loading a checkpoint from elsewhere runs no
code from it. That is also why optimizer state is split into a tensors file and a JSON structure
(:func:`encode`), and why tied weights are stored once: ``save_pretrained`` does the same, and
``from_pretrained`` expects it. Directories written by ``save_pretrained`` itself (one file or an
index of shards) are read here too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import torch
from torch import nn

from ..errors import CheckpointError
from .confine import inside, read_json
from .keys import DCP_METADATA, tied_names
from .manifest import MANIFEST

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"


def _safetensors():
    try:
        import safetensors.torch as st
        from safetensors import safe_open
    except ImportError as e:
        raise CheckpointError(
            "FULL_STATE_DICT checkpoints are safetensors files: pip install safetensors (or 'shardcore[hf]')."
        ) from e
    return st, safe_open


# ------------------------------------------------------------------------------------ writing


def write_full(
    tmp: Path, model: nn.Module, state: dict[str, Any], osd: dict[str, Any] | None, weights: str = WEIGHTS
) -> None:
    """``state`` as the safetensors file ``weights`` (tied names once), ``osd`` beside it."""
    st, _ = _safetensors()
    drop = tied_names(model)
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for k, v in state.items():
        if k in drop:
            continue
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(
                f"shardcore.save: state dict entry {k!r} is a {type(v).__name__}, not a tensor; safetensors stores "
                "tensors only. Save this model with state_dict_type='SHARDED_STATE_DICT'."
            )
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        if ptr in storages:  # safetensors refuses tensors that share memory
            v = v.clone()
        storages.add(ptr)
        tensors[k] = v
    st.save_file(tensors, str(tmp / weights), metadata={"format": "pt"})
    if osd is not None:
        write_encoded(osd, tmp / OPTIMIZER_TENSORS, tmp / OPTIMIZER_META)


def write_encoded(obj: Any, tensors: Path, meta: Path, what: str = "optimizer state") -> None:
    """``obj``'s tensors to the safetensors file ``tensors``, the rest to the JSON file ``meta``."""
    st, _ = _safetensors()
    flat: dict[str, torch.Tensor] = {}
    structure = encode(obj, "", flat, what)
    st.save_file(flat, str(tensors), metadata={"format": "pt"})
    meta.write_text(json.dumps(structure))


def encode(obj: Any, prefix: str, flat: dict[str, torch.Tensor], what: str = "optimizer state") -> Any:
    """``obj`` (``what``: optimizer state, or a manager's extra state) as JSON, with its tensors
    moved into ``flat`` (one safetensors file)."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        flat[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, Mapping):
        return {"__dict__": [[k, encode(v, f"{prefix}/{k}", flat, what)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{prefix}/{i}", flat, what) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{prefix}/{i}", flat, what) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if what != "optimizer state":
        raise CheckpointError(
            f"shardcore: {what} {prefix!r} is a {type(obj).__name__}, which a checkpoint cannot store without "
            "pickle. Make state_dict() return tensors, numbers, strings, lists and dicts."
        )
    raise CheckpointError(
        f"shardcore.save: optimizer state {prefix!r} is a {type(obj).__name__}, which a FULL checkpoint cannot "
        "store without pickle. Use state_dict_type='SHARDED_STATE_DICT' for this optimizer."
    )


def write_hf_config(tmp: Path, model: nn.Module) -> None:
    """``config.json`` (and ``generation_config.json``) of a Transformers model, as save_pretrained.

    Both formats get it: a checkpoint then carries what rebuilds its model, whatever the format."""
    cfg = getattr(model, "config", None)
    if cfg is None or not callable(getattr(cfg, "save_pretrained", None)):
        return
    cfg = copy.deepcopy(cfg)
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(tmp)
    gen = getattr(model, "generation_config", None)
    if gen is not None and callable(getattr(gen, "save_pretrained", None)):
        gen.save_pretrained(tmp)


# ------------------------------------------------------------------------------------ reading


def weight_files(src: Path) -> list[Path]:
    if src.is_file():
        if src.suffix == ".safetensors":
            return [src]
        raise CheckpointError(
            f"shardcore.load: {str(src)!r} is not a checkpoint: a file that is not .safetensors. Pass a directory "
            "written by shardcore.save() or save_pretrained(), or a .safetensors file."
        )
    if (src / WEIGHTS).is_file():
        return [inside(src, WEIGHTS, "the weights file")]
    index = src / WEIGHTS_INDEX
    if index.is_file():
        data = read_json(
            src, WEIGHTS_INDEX, "the safetensors index", "It is not a safetensors index, or it is damaged."
        )
        try:
            names = sorted(set(data["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"shardcore.load: {str(index)!r} is not a safetensors index ({e!r}).") from None
        files = [inside(src, n, f"{WEIGHTS_INDEX}'s weight_map") for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shardcore.load: {str(index)!r} names shards that are missing: {missing[:3]}.")
        return files
    found = sorted(p.name for p in src.iterdir())[:8] if src.is_dir() else []
    hint = (
        " (pytorch_model.bin is pickle; convert it with save_pretrained(safe_serialization=True))"
        if (src / "pytorch_model.bin").exists()
        else ""
    )
    raise CheckpointError(
        f"shardcore.load: {str(src)!r} is not a checkpoint: it has no {MANIFEST}, {WEIGHTS}, {WEIGHTS_INDEX} or "
        f"{DCP_METADATA} (found: {found or 'nothing'}){hint}. Pass a directory written by shardcore.save() or "
        "save_pretrained()."
    )


class TensorRef(NamedTuple):
    """A tensor of a checkpoint, not read: its key, global shape, dtype (None for one torch lacks a
    name for here) and the file holding it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    file: Path


#: safetensors' dtype names (``get_slice(k).get_dtype()``)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def file_tensors(files: Iterable[Path]) -> dict[str, TensorRef]:
    """Every tensor in ``files``, from the headers only: checking them costs no tensor reads."""
    _, safe_open = _safetensors()
    out: dict[str, TensorRef] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    out[k] = TensorRef(k, tuple(sl.get_shape()), DTYPES.get(sl.get_dtype()), f)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"shardcore.load: {str(f)!r} is not a readable safetensors file ({e}).") from None
    return out


def file_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    return {k: ref.shape for k, ref in file_tensors(files).items()}


def _damaged(f: Path, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"shardcore.load: {str(f)!r} is damaged ({type(e).__name__}: {e}). Nothing was loaded from it; save the "
        "checkpoint again."
    )


def read_weights(files: Iterable[Path], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    st, _ = _safetensors()
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(st.load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise _damaged(f, e) from None
    for name, kept in aliases.items():  # a tied weight is stored once; the model wants every name
        if name not in state and kept in state:
            state[name] = state[kept]
    return state


#: how much of one tensor a rank copies out of a memory-mapped file at a time: the mapped pages it
#: touches count in its resident memory until the file is closed, so each piece is read through a
#: mapping of its own and closed before the next (opening costs a read of the JSON header)
SLICE_BYTES = 16 * 2**20


class SliceReader:
    """Parts of the tensors of safetensors files, read through memory maps (``safe_open`` and
    ``get_slice``): a rank copies only the rows it keeps, and no file is ever read whole."""

    def __init__(self, files: Iterable[Path], aliases: Mapping[str, str]) -> None:
        _, self._open = _safetensors()
        self._file = {k: ref.file for k, ref in file_tensors(files).items()}
        # a tied weight is stored once, under either of its names
        self._aliases = {**{v: k for k, v in aliases.items()}, **aliases}

    def key(self, name: str) -> str:
        if name in self._file:
            return name
        other = self._aliases.get(name)
        if other in self._file:
            return other
        raise CheckpointError(f"shardcore.load: the checkpoint has no tensor {name!r} (nor a tied twin of it).")

    def fill(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy ``checkpoint[name][index]`` into ``out``, a few MiB of rows at a time."""
        if out.numel() == 0:
            return
        key = self.key(name)
        path = str(self._file[key])
        if out.dim() == 0:
            with self._open(path, framework="pt") as h:
                out.copy_(h.get_tensor(key))
            return
        first = index[0].start or 0
        per_row = max(1, out[0].numel() * out.element_size())
        step = max(1, SLICE_BYTES // per_row)
        with torch.no_grad():
            for start in range(first, first + out.shape[0], step):
                stop = min(start + step, first + out.shape[0])
                with self._open(path, framework="pt") as h:
                    part = h.get_slice(key)[(slice(start, stop), *index[1:])]
                out[start - first : stop - first].copy_(part)
                del part


def optimizer_files(src: Path, optimizer: Any) -> tuple[Path, Path]:
    tensors = inside(src, OPTIMIZER_TENSORS, "the optimizer state")
    meta = inside(src, OPTIMIZER_META, "the optimizer state")
    if optimizer is not None and not (tensors.is_file() and meta.is_file()):
        raise CheckpointError(
            f"shardcore.load: an optimizer was passed but {str(src)!r} holds no optimizer state ({OPTIMIZER_META} "
            "missing). Load without optimizer=, or save with shardcore.save(model, path, optimizer)."
        )
    return tensors, meta


def read_optimizer(tensors: Path, meta: Path, what: str = "the optimizer state") -> dict[str, Any]:
    """What :func:`encode` wrote to ``tensors`` and ``meta`` (``what`` names it in errors)."""
    st, _ = _safetensors()
    try:
        flat = st.load_file(str(tensors))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise _damaged(tensors, e) from None
    return _decode_file(meta, flat, what)


def _decode_file(meta: Path, flat: Mapping[str, Any], what: str = "the optimizer state") -> Any:
    data = read_json(meta.parent, meta.name, what)
    try:
        return _decode(data, flat)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise _damaged(meta, e) from None


def optimizer_refs(tensors: Path, meta: Path) -> dict[str, Any]:
    """The optimizer state dict with a :class:`TensorRef` for every tensor, from the header only."""
    refs = file_tensors([tensors])
    odd = sorted(k for k, ref in refs.items() if ref.dtype is None)
    if odd:
        raise CheckpointError(
            f"shardcore.load: {str(tensors)!r} holds tensors of a dtype shardcore cannot read: {odd[:3]}."
        )
    return _decode_file(meta, refs)


def _decode(obj: Any, flat: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return flat[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_decode(v, flat) for v in obj["__tuple__"])
        return {k: _decode(v, flat) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_decode(v, flat) for v in obj]
    return obj
