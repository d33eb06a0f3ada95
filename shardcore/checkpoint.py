"""Checkpoints: one backend-neutral API, two formats.

``FULL_STATE_DICT``
    One unsharded state dict with the model's original parameter names, gathered to rank 0 and
    written as ``model.safetensors`` (no pickle). A Hugging Face model also gets its
    ``config.json`` (and ``generation_config.json``), so the directory is what ``save_pretrained``
    writes and ``AutoModelForCausalLM.from_pretrained(path)`` loads it on one device. Optimizer
    state, keyed by parameter name, goes to ``optimizer.safetensors`` (tensors) and
    ``optimizer.json`` (the rest). Tied weights are stored once, as ``save_pretrained`` does.
    Any backend (or plain PyTorch) reads and writes this format.

``SHARDED_STATE_DICT``
    ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards; a later run may have
    another world size. It loads only into a sharded model; save FULL to share a model.

Both are directories with a ``shardcore.json`` manifest, written last. A save goes into a
temporary sibling directory and is renamed into place only after every rank has finished, so a
process that dies in the middle of a save leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from . import safe_dcp
from .backend import World
from .capabilities import RenamesParameters, ShardedCheckpoints
from .config import ShardConfig, parse_config
from .errors import CheckpointError, ShardcoreError

log = logging.getLogger(__name__)

FULL = "FULL_STATE_DICT"
SHARDED = "SHARDED_STATE_DICT"

MANIFEST = "shardcore.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1

_TMP_TAG = ".shardcore-tmp-"
_OLD_TAG = ".shardcore-old"


# ------------------------------------------------------------------------------------ public API


def save(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state_dict_type: str | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) to the directory ``path``. Collective: call on every rank.

    The format is ``state_dict_type`` if given, else the config's ``state_dict_type`` (a model not
    sharded by shardcore saves FULL). An existing shardcore checkpoint at ``path`` is replaced
    atomically once the new one is complete; anything else at ``path`` is never touched.
    """
    runtime, cfg = _runtime(model)
    kind = _state_dict_type(state_dict_type, cfg)
    if kind == SHARDED and cfg is None:
        raise CheckpointError(
            f"shardcore.save({str(path)!r}): state_dict_type SHARDED_STATE_DICT needs a model returned by "
            f"shardcore.shard(), got an unsharded {type(model).__name__}. Save FULL_STATE_DICT instead."
        )
    world = runtime.world()
    final = Path(path)
    tmp = Path(_on_rank0(runtime, lambda: str(_prepare_destination(final))))
    try:
        manifest = _manifest(model, kind, world, runtime, optimizer is not None)
        if kind == FULL:
            state = runtime.full_state_dict(model)
            osd = runtime.full_optimizer_state_dict(model, optimizer) if optimizer is not None else None

            def write_full() -> None:
                _write_full(tmp, model, state, osd)
                _write_hf_config(tmp, model)
                _write_manifest(tmp, manifest)
                _commit(tmp, final)

            _on_rank0(runtime, write_full)
            del state, osd
        else:
            _sharded_checkpoints(runtime, "save", path).save_sharded_state_dict(model, optimizer, str(tmp))

            def finish_sharded() -> None:
                _write_hf_config(tmp, model)
                _write_manifest(tmp, manifest)
                _commit(tmp, final)

            _on_rank0(runtime, finish_sharded)
    except BaseException:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("shardcore: saved %s checkpoint to %s", kind, final)
    return final


def load(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) in place. Collective: call on every rank.

    ``path`` is a shardcore checkpoint (either format, detected from disk), a directory written by
    ``save_pretrained`` (``model.safetensors`` or an index of safetensors shards), or a single
    ``.safetensors`` file. For a sharded model, build the optimizer after ``shard()`` and before
    ``load``. Returns the checkpoint's manifest (empty for a checkpoint not written by shardcore).
    """
    runtime, cfg = _runtime(model)
    src = _resolve_checkpoint(path)
    manifest = _read_manifest(src)
    kind = manifest.get("state_dict_type") or (
        SHARDED if (src / DCP_METADATA).is_file() or (src / SHARD_INDEX).is_file() else FULL
    )
    if kind == SHARDED:
        if cfg is None:
            raise CheckpointError(
                f"shardcore.load({str(path)!r}): this is a SHARDED_STATE_DICT checkpoint "
                f"(torch.distributed.checkpoint, saved by {manifest.get('world_size', '?')} ranks); it loads only "
                f"into a model returned by shardcore.shard(), not into an unsharded {type(model).__name__}. "
                "Shard the model first (any world size), or load it in a sharded run and save it again with "
                "state_dict_type='FULL_STATE_DICT' to get a file any PyTorch or Transformers program reads."
            )
        _sharded_checkpoints(runtime, "load", path)
        _check_sharded(model, src, optimizer)
        runtime.load_sharded_state_dict(model, optimizer, str(src))
    else:
        files = _weight_files(src)
        _check_keys(_expected_shapes(model), _file_shapes(files), tied_names(model), str(src))
        opt_files = _optimizer_files(src, optimizer)
        rank0 = runtime.world().rank == 0
        state = _read_weights(files, tied_names(model)) if rank0 else {}
        runtime.load_full_state_dict(model, state)
        del state
        if optimizer is not None:
            osd = _read_optimizer(*opt_files) if rank0 else {}
            runtime.load_full_optimizer_state_dict(model, optimizer, osd)
    log.info("shardcore: loaded %s checkpoint from %s", kind, src)
    return manifest


def from_pretrained(
    model_cls: Any,
    path: str | os.PathLike,
    config: Any = None,
    *,
    backend: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """``model_cls.from_pretrained(path, **kwargs)``, then :func:`shardcore.shard`.

    ``model_cls`` is a Transformers model class or Auto class (``AutoModelForCausalLM``); ``path``
    a local directory (a FULL shardcore checkpoint is one). With ``cpu_ram_efficient_loading: true``
    in ``config`` only rank 0 reads the weights; every other rank builds the model from its
    ``config.json`` on the meta device, and ``shard`` broadcasts rank 0's weights (and non-persistent
    buffers such as rotary ``inv_freq``) while sharding. Peak CPU memory on those ranks is then about
    their shard, not the whole model.
    """
    from .api import shard
    from .distributed import env_world

    cfg = parse_config(config)
    rank = env_world()[0]
    if cfg.cpu_ram_efficient_loading and rank == 0 and not cfg.xla_fsdp_v2:
        # ranks that are not launcher processes (XLA FSDP's device threads) know their rank from the backend
        from .backend import resolve_backend

        rank = resolve_backend(cfg, backend).world().rank
    with _BUILD_LOCK:
        model = _build_pretrained(model_cls, path, cfg, rank, kwargs)
    return shard(model, cfg, backend=backend)


# Device threads (XLA FSDP on CPU) may call from_pretrained at once, and Transformers' lazy module
# loading is not thread-safe; building one model at a time costs the other ranks nothing but a wait.
_BUILD_LOCK = threading.Lock()


def _build_pretrained(
    model_cls: Any, path: str | os.PathLike, cfg: ShardConfig, rank: int, kwargs: dict[str, Any]
) -> nn.Module:
    if cfg.cpu_ram_efficient_loading and rank != 0:
        try:
            from transformers import AutoConfig
        except ImportError as e:  # pragma: no cover - transformers is an extra
            raise CheckpointError("shardcore.from_pretrained needs transformers: pip install 'shardcore[hf]'.") from e
        hf_config = AutoConfig.from_pretrained(path)
        build_kwargs = {
            k: kwargs[k] for k in ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code") if k in kwargs
        }
        build = getattr(model_cls, "from_config", None) or getattr(model_cls, "_from_config")
        with torch.device("meta"):
            return build(hf_config, **build_kwargs)
    return model_cls.from_pretrained(path, **kwargs)


# ------------------------------------------------------------------------------------ runtimes


class LocalRuntime:
    """The checkpoint side of a backend for a model that shardcore did not shard (one device)."""

    name = "single-device"

    def world(self) -> World:
        return World(0, 1, torch.device("cpu"))

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        model.load_state_dict(state_dict, strict=True)

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return _to_cpu(osd)

    def load_full_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, osd)


def _runtime(model: nn.Module) -> tuple[Any, ShardConfig | None]:
    from .api import handle_or_none

    if not isinstance(model, nn.Module):
        raise CheckpointError(f"shardcore checkpoints: expected a torch.nn.Module, got {type(model).__name__}.")
    h = handle_or_none(model)
    if h is None:
        return LocalRuntime(), None
    return h.backend, h.config


def _sharded_checkpoints(runtime: Any, verb: str, path: Any) -> ShardedCheckpoints:
    if not isinstance(runtime, ShardedCheckpoints):
        raise CheckpointError(
            f"shardcore.{verb}({str(path)!r}): the {runtime.name!r} backend does not implement SHARDED_STATE_DICT "
            "checkpoints (shardcore.capabilities.ShardedCheckpoints). Use state_dict_type='FULL_STATE_DICT'."
        )
    return runtime


def _state_dict_type(value: str | None, cfg: ShardConfig | None) -> str:
    if value is None:
        return cfg.state_dict_type if cfg is not None else FULL
    # the config's own validator: the same spellings are accepted and the same error names the key
    return parse_config({"state_dict_type": value}).state_dict_type


def _on_rank0(runtime: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only; every rank returns its result or raises its error.

    The other ranks wait in the broadcast, so a failure on rank 0 stops every rank instead of
    leaving them waiting in a later collective.
    """
    outcome: tuple[bool, Any] = (True, None)
    error: BaseException | None = None
    if runtime.world().rank == 0:
        try:
            outcome = (True, fn())
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised below
            error = e
            outcome = (False, f"{type(e).__name__}: {e}" if not isinstance(e, ShardcoreError) else str(e))
    ok, value = runtime.broadcast_object(outcome)
    if error is not None:
        raise error
    if not ok:
        raise CheckpointError(f"rank 0 failed: {value}")
    return value


# ------------------------------------------------------------------------------------ atomic write


def _is_checkpoint(p: Path) -> bool:
    return p.is_dir() and (p / MANIFEST).is_file()


def _prepare_destination(final: Path) -> Path:
    """Check that ``final`` may be written, and make the temporary sibling the save goes into."""
    if final.exists() or final.is_symlink():
        if final.is_dir() and not final.is_symlink():
            if not _is_checkpoint(final) and any(final.iterdir()):
                raise CheckpointError(
                    f"shardcore.save: {str(final)!r} is a directory that is not a shardcore checkpoint (no "
                    f"{MANIFEST}); refusing to overwrite it. Pass a new path or remove the directory."
                )
        else:
            raise CheckpointError(
                f"shardcore.save: {str(final)!r} exists and is not a directory; refusing to overwrite it. "
                "Pass a new directory path."
            )
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}{_TMP_TAG}{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(
            f"shardcore.save: cannot create a directory beside {str(final)!r} ({e}). Check the path and its permissions."
        ) from e
    return tmp


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` to ``final``; an old checkpoint there is swapped out, then deleted."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~umask)  # safetensors writes 0600 files; a checkpoint is meant to be shared
            _fsync(f)
    _fsync(tmp)
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
    _fsync(final.parent)
    shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint (or nothing)
    for stale in final.parent.glob(f".{final.name}{_TMP_TAG}*"):  # left by saves that were killed
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


def _resolve_checkpoint(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        old = p.parent / f".{p.name}{_OLD_TAG}"
        if _is_checkpoint(old):
            log.warning("shardcore: %s is missing but %s exists (a save was interrupted); loading it", p, old)
            return old
        raise CheckpointError(
            f"shardcore.load: {str(p)!r} does not exist. Pass the directory shardcore.save() or save_pretrained() wrote."
        )
    return p


def _read_manifest(src: Path) -> dict[str, Any]:
    if not src.is_dir():
        return {}
    m = src / MANIFEST
    if not m.is_file():
        return {}
    try:
        data = json.loads(m.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"shardcore.load: {str(m)!r} is not readable JSON ({e}). The checkpoint is damaged; save it again."
        ) from None
    if not isinstance(data, dict) or data.get("format") != "shardcore":
        raise CheckpointError(
            f"shardcore.load: {str(m)!r} is not a shardcore manifest. Remove it or pass another path."
        )
    if data.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"shardcore.load: {str(src)!r} has checkpoint format version {data.get('version')}, newer than this "
            f"shardcore reads ({FORMAT_VERSION}). Upgrade shardcore."
        )
    return data


def _manifest(model: nn.Module, kind: str, world: World, runtime: Any, has_optimizer: bool) -> dict[str, Any]:
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


def _write_manifest(tmp: Path, manifest: dict[str, Any]) -> None:
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _write_hf_config(tmp: Path, model: nn.Module) -> None:
    """``config.json`` (and ``generation_config.json``) of a Transformers model, as save_pretrained."""
    cfg = getattr(model, "config", None)
    if cfg is None or not callable(getattr(cfg, "save_pretrained", None)):
        return
    cfg = copy.deepcopy(cfg)
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(tmp)
    gen = getattr(model, "generation_config", None)
    if gen is not None and callable(getattr(gen, "save_pretrained", None)):
        gen.save_pretrained(tmp)


# ------------------------------------------------------------------------------------ FULL format


def _safetensors():
    try:
        import safetensors.torch as st
        from safetensors import safe_open
    except ImportError as e:
        raise CheckpointError(
            "FULL_STATE_DICT checkpoints are safetensors files: pip install safetensors (or 'shardcore[hf]')."
        ) from e
    return st, safe_open


def tied_names(model: nn.Module) -> dict[str, str]:
    """Tied parameters: ``{name that is not stored: name that is}``, as ``save_pretrained`` decides
    (the names a Transformers model lists in ``_tied_weights_keys`` are the ones dropped).
    A backend whose wrappers rename parameters answers for its models (RenamesParameters)."""
    runtime = _runtime(model)[0]
    if isinstance(runtime, RenamesParameters):
        return runtime.tied_aliases(model)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    declared: set[str] = set()
    for prefix, sub in model.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or ()
        declared.update(f"{prefix}.{k}" if prefix else k for k in tied)
    out: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        kept = next((n for n in names if n not in declared), names[0])
        out.update({n: kept for n in names if n != kept})
    return out


def _write_full(tmp: Path, model: nn.Module, state: dict[str, Any], osd: dict[str, Any] | None) -> None:
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
    st.save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    if osd is not None:
        flat: dict[str, torch.Tensor] = {}
        structure = _encode(osd, "", flat)
        st.save_file(flat, str(tmp / OPTIMIZER_TENSORS), metadata={"format": "pt"})
        (tmp / OPTIMIZER_META).write_text(json.dumps(structure))


def _encode(obj: Any, prefix: str, flat: dict[str, torch.Tensor]) -> Any:
    """Optimizer state as JSON, with its tensors moved into ``flat`` (one safetensors file)."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        flat[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, Mapping):
        return {"__dict__": [[k, _encode(v, f"{prefix}/{k}", flat)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{prefix}/{i}", flat) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{prefix}/{i}", flat) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(
        f"shardcore.save: optimizer state {prefix!r} is a {type(obj).__name__}, which a FULL checkpoint cannot "
        "store without pickle. Use state_dict_type='SHARDED_STATE_DICT' for this optimizer."
    )


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


def _weight_files(src: Path) -> list[Path]:
    if src.is_file():
        if src.suffix == ".safetensors":
            return [src]
        raise CheckpointError(
            f"shardcore.load: {str(src)!r} is not a checkpoint: a file that is not .safetensors. Pass a directory "
            "written by shardcore.save() or save_pretrained(), or a .safetensors file."
        )
    if (src / WEIGHTS).is_file():
        return [src / WEIGHTS]
    index = src / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"shardcore.load: {str(index)!r} is not a safetensors index ({e}).") from None
        files = [src / n for n in names]
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


def _file_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    _, safe_open = _safetensors()
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    out[k] = tuple(h.get_slice(k).get_shape())
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"shardcore.load: {str(f)!r} is not a readable safetensors file ({e}).") from None
    return out


def _read_weights(files: Iterable[Path], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    st, _ = _safetensors()
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(st.load_file(str(f)))
    for name, kept in aliases.items():  # a tied weight is stored once; the model wants every name
        if name not in state and kept in state:
            state[name] = state[kept]
    return state


def _optimizer_files(src: Path, optimizer: Any) -> tuple[Path, Path]:
    tensors, meta = src / OPTIMIZER_TENSORS, src / OPTIMIZER_META
    if optimizer is not None and not (tensors.is_file() and meta.is_file()):
        raise CheckpointError(
            f"shardcore.load: an optimizer was passed but {str(src)!r} holds no optimizer state ({OPTIMIZER_META} "
            "missing). Load without optimizer=, or save with shardcore.save(model, path, optimizer)."
        )
    return tensors, meta


def _read_optimizer(tensors: Path, meta: Path) -> dict[str, Any]:
    st, _ = _safetensors()
    return _decode(json.loads(meta.read_text()), st.load_file(str(tensors)))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


# ------------------------------------------------------------------------------------ validation


def _expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of ``model`` with its global shape (a sharded tensor reports the whole).

    A backend whose wrappers rename or flatten parameters (XLA FSDP) says it itself
    (RenamesParameters)."""
    runtime = _runtime(model)[0]
    if isinstance(runtime, RenamesParameters):
        return runtime.full_state_dict_shapes(model)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _check_keys(
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


#: the index a backend writes beside its own per-rank shards where torch.distributed.checkpoint
#: cannot be used (XLA FSDP's device threads have no torch.distributed group): JSON with ``keys``
#: (unwrapped name -> global shape) and ``optimizer`` (whether optimizer state is in it)
SHARD_INDEX = "shards.json"


def _check_sharded(model: nn.Module, src: Path, optimizer: Any) -> None:
    index = src / SHARD_INDEX
    if index.is_file() and not (src / DCP_METADATA).is_file():
        try:
            data = json.loads(index.read_text())
            found, has_optimizer = {k: tuple(v) for k, v in data["keys"].items()}, bool(data["optimizer"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
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
    _check_keys(_expected_shapes(model), found, tied_names(model), str(src))
    if optimizer is not None and not has_optimizer:
        raise CheckpointError(
            f"shardcore.load: an optimizer was passed but {str(src)!r} holds no optimizer state. Load without "
            "optimizer=, or save with shardcore.save(model, path, optimizer)."
        )
