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

This module is the recipe; each step lives with its concern: :mod:`.runtime` (which backend does
the collective work), :mod:`.atomic` (replacing a directory in one step), :mod:`.manifest`,
:mod:`.full` (the safetensors files) and :mod:`.keys` (does the checkpoint fit the model).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capabilities import AsyncFullCheckpoints, AsyncShardedCheckpoints, SlicedLoading
from ..empty import awaiting_weights, weights_arrived
from ..errors import CheckpointError, ShardcoreError
from ..integrations import peft
from . import atomic, full, keys, manifest
from .confine import inside
from .full import OPTIMIZER_META, OPTIMIZER_TENSORS, WEIGHTS, WEIGHTS_INDEX
from .keys import DCP_METADATA, SHARD_INDEX, tied_names
from .manifest import FORMAT_VERSION, MANIFEST
from .pretrained import from_pretrained
from .runtime import FULL, SHARDED, LocalRuntime, on_rank0, resolve_state_dict_type, runtime_of, sharded_checkpoints

__all__ = [
    "CheckpointManager",
    "DCP_METADATA",
    "FORMAT_VERSION",
    "FULL",
    "MANIFEST",
    "OPTIMIZER_META",
    "OPTIMIZER_TENSORS",
    "SHARDED",
    "SHARD_INDEX",
    "WEIGHTS",
    "WEIGHTS_INDEX",
    "LocalRuntime",
    "from_pretrained",
    "load",
    "save",
    "tied_names",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ save


def save(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state_dict_type: str | None = None,
    merged: bool = False,
) -> Path:
    """Save ``model`` (and ``optimizer``) to the directory ``path``. Collective: call on every rank.

    The format is ``state_dict_type`` if given, else the config's ``state_dict_type`` (a model not
    sharded by shardcore saves FULL). An existing shardcore checkpoint at ``path`` is replaced
    atomically once the new one is complete; anything else at ``path`` is never touched.

    A PEFT model's FULL checkpoint is what ``PeftModel.save_pretrained`` writes: ``adapter_config.json``
    and ``adapter_model.safetensors`` (the adapter's weights only, gathered from every rank, under PEFT's
    key names). With ``merged=True`` it is instead the base Transformers model with the adapter folded
    into its weights, which ``AutoModelForCausalLM.from_pretrained`` loads.
    """
    staged = stage(model, path, optimizer, state_dict_type=state_dict_type, merged=merged)
    try:
        on_rank0(staged.runtime, staged.write)
    except BaseException:
        staged.discard()
        raise
    log.info("shardcore: saved %s checkpoint to %s", staged.kind, staged.final)
    return staged.final


class Staged:
    """A save whose collective part is done: what is left is rank 0's, with no collective, so it
    may run in a background thread (:class:`CheckpointManager`'s ``async_save``).

    ``write()`` (rank 0) writes the gathered FULL files and commits the directory. A SHARDED save
    was written by every rank already, or is being written in the background: ``write()`` waits for
    that and commits. ``wait()`` waits, on any rank, for that rank's own background part."""

    def __init__(
        self, runtime: Any, kind: str, tmp: Path, final: Path, finish: Any, pending: Any = None, gathers: bool = False
    ) -> None:
        self.runtime, self.kind, self.tmp, self.final = runtime, kind, tmp, final
        self._finish = finish
        self._pending = pending
        self._gathers = gathers  # the pending part returns what finish() writes
        self._result: Any = None

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._result = pending()

    def write(self) -> None:
        self.wait()
        self._finish(self._result) if self._gathers else self._finish()

    def discard(self) -> None:
        if self.runtime.world().rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)


def stage(
    model: nn.Module,
    path: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state_dict_type: str | None = None,
    merged: bool = False,
    background: bool = False,
) -> Staged:
    """The collective part of :func:`save`: check, gather (FULL) or write (SHARDED) the state.
    Collective. With ``background``, the state is copied where the model could change it under the
    writer (a FULL state of an unsharded tensor is the tensor itself), and a SHARDED save whose
    backend can (``AsyncShardedCheckpoints``) is staged in CPU memory and written in the background."""
    runtime, cfg = runtime_of(model)
    peft_model = peft.peft_of(model)
    if merged and (peft_model is None or optimizer is not None):
        raise CheckpointError(
            f"shardcore.save({str(path)!r}, merged=True): "
            + (
                f"merging folds a PEFT adapter into its base model, and {type(model).__name__} is no PEFT model. "
                "Save without merged=True."
                if peft_model is None
                else "a merged model has no adapter left for the optimizer's state. Save the optimizer with the "
                "adapter checkpoint (merged=False), and export the merged model without optimizer=."
            )
        )
    if awaiting_weights(model):
        raise CheckpointError(
            f"shardcore.save({str(path)!r}): this model was sharded without weights and nothing was loaded into "
            "it yet, so it would save uninitialized memory. Call shardcore.load(model, path) first."
        )
    kind = FULL if merged else resolve_state_dict_type(state_dict_type, cfg)
    if kind == SHARDED and cfg is None:
        raise CheckpointError(
            f"shardcore.save({str(path)!r}): state_dict_type SHARDED_STATE_DICT needs a model returned by "
            f"shardcore.shard(), got an unsharded {type(model).__name__}. Save FULL_STATE_DICT instead."
        )
    world = runtime.world()
    final = Path(path)
    tmp = Path(on_rank0(runtime, lambda: str(atomic.prepare_destination(final))))
    try:
        meta = manifest.build_manifest(model, kind, world, runtime, optimizer is not None)
        if kind == SHARDED:
            return _stage_sharded(runtime, model, optimizer, path, tmp, final, meta, background)
        if peft_model is not None:
            meta["peft"] = "merged" if merged else "adapter"
            write = functools.partial(_write_peft, model, peft_model, tmp=tmp, final=final, meta=meta, merged=merged)
        else:
            write = functools.partial(_write_full, model, tmp=tmp, final=final, meta=meta)
        if background and isinstance(runtime, AsyncFullCheckpoints):
            # the gather too runs in the background: write() receives (state, osd) from it
            gather = runtime.snapshot_full_state_dict(model, optimizer)
            return Staged(runtime, kind, tmp, final, lambda gathered: write(*gathered), gather, gathers=True)
        state = runtime.full_state_dict(model)
        osd = runtime.full_optimizer_state_dict(model, optimizer) if optimizer is not None else None
        if background and world.rank == 0:
            state, osd = _unshared(model, optimizer, state), _unshared(model, optimizer, osd)
        return Staged(runtime, kind, tmp, final, functools.partial(write, state, osd))
    except BaseException:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _unshared(model: nn.Module, optimizer: Any, state: Any) -> Any:
    """``state`` with a copy of each tensor whose memory the model or the optimizer owns (training
    goes on while a background writer reads it); tensors gathered for the save are kept as they are."""
    if state is None:
        return None
    live = {_memory(t) for t in (*model.parameters(), *model.buffers())}
    if optimizer is not None:
        for per_param in optimizer.state.values():
            live.update(_memory(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    live.discard(None)

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.detach().clone() if _memory(obj) in live else obj
        if isinstance(obj, dict):
            return {k: copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(copy(v) for v in obj)
        return obj

    return copy(state)


def _memory(t: torch.Tensor) -> int | None:
    """Where ``t``'s data lives (a DTensor's: its local shard's), or None for a tensor without host
    storage (an XLA tensor, which the gather has copied to the CPU anyway)."""
    local = getattr(t, "_local_tensor", t)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _write_full(
    model: nn.Module, state: dict[str, Any], osd: Any, *, tmp: Path, final: Path, meta: dict[str, Any]
) -> None:
    """Rank 0, after the gather: write the files, then commit."""
    full.write_full(tmp, model, state, osd)
    _finish(tmp, final, model, meta)


def _write_peft(
    model: nn.Module,
    peft_model: Any,
    state: dict[str, Any],
    osd: Any,
    *,
    tmp: Path,
    final: Path,
    meta: dict[str, Any],
    merged: bool,
) -> None:
    """Rank 0, after the gather: the adapter directory, or the merged model."""
    if merged:
        plain = peft.merged_model(peft_model, state)
        full.write_full(tmp, plain, plain.state_dict(), None)
        _finish(tmp, final, plain, meta)
        return
    full.write_full(tmp, model, peft.adapter_state(peft_model, state), osd, weights=peft.ADAPTER_WEIGHTS)
    peft.write_adapter_config(tmp, peft_model)
    _finish(tmp, final, model, meta, hf_config=False)


def _stage_sharded(
    runtime: Any,
    model: nn.Module,
    optimizer: Any,
    path: Any,
    tmp: Path,
    final: Path,
    meta: dict[str, Any],
    background: bool,
) -> Staged:
    """Every rank writes its own shards (a collective), now or, staged, in the background."""
    finish = functools.partial(_finish, tmp, final, model, meta)
    if background and isinstance(runtime, AsyncShardedCheckpoints):
        pending = runtime.async_save_sharded_state_dict(model, optimizer, str(tmp))
        return Staged(runtime, SHARDED, tmp, final, finish, pending)
    sharded_checkpoints(runtime, "save", path).save_sharded_state_dict(model, optimizer, str(tmp))
    return Staged(runtime, SHARDED, tmp, final, finish)


def _finish(tmp: Path, final: Path, model: nn.Module, meta: dict[str, Any], hf_config: bool = True) -> None:
    """Rank 0, after the data is written: the manifest goes last, so only a complete directory has
    one, and only then is it moved into place. (An adapter directory gets no ``config.json``: it
    would make it look like a whole model to ``from_pretrained``.)"""
    if hf_config:
        full.write_hf_config(tmp, model)
    manifest.write_manifest(tmp, meta)
    atomic.commit(tmp, final)


# ------------------------------------------------------------------------------------ load


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
    runtime, cfg = runtime_of(model)
    src = atomic.resolve_checkpoint(path)
    meta = manifest.read_manifest(src)
    kind = meta.get("state_dict_type") or _detect_kind(src)
    writing = _Writing()
    peft_model = peft.peft_of(model)
    try:
        if kind == SHARDED:
            _load_sharded(runtime, cfg, model, optimizer, path, src, meta, writing)
        elif src.is_dir() and peft.is_adapter_dir(src):
            if peft_model is None:
                raise CheckpointError(
                    f"shardcore.load({str(path)!r}): this is a PEFT adapter ({peft.ADAPTER_CONFIG}), and "
                    f"{type(model).__name__} is no PEFT model. Wrap the base model first (peft.get_peft_model(base, "
                    "LoraConfig(...)) with the adapter's config), then shard and load."
                )
            _load_adapter(runtime, model, peft_model, optimizer, src, writing)
        else:
            _load_full(runtime, model, optimizer, src, writing)
    except Exception as e:
        raise _load_error(e, src, writing.started) from e
    log.info("shardcore: loaded %s checkpoint from %s", kind, src)
    return meta


class _Writing:
    """Whether a load has begun to write into the model: an error before that leaves the model as
    it was, one after says that it may not be."""

    started = False


#: appended to an error raised once the model's tensors were being written
PARTLY_LOADED = (
    "The model (and optimizer) may hold part of this checkpoint now: load a good checkpoint into it before training on."
)


def _load_error(e: Exception, src: Path, started: bool) -> Exception:
    """A load's error as a :class:`CheckpointError` (on every rank, as each rank raises its own or
    learns of rank 0's), saying whether the model was touched."""
    if isinstance(e, ShardcoreError) and not isinstance(e, CheckpointError):
        return e
    message = (
        str(e)
        if isinstance(e, CheckpointError)
        else f"shardcore.load: reading {str(src)!r} failed ({type(e).__name__}: {e}). The checkpoint may be damaged, "
        "or not be one for this model."
    )
    if started and PARTLY_LOADED not in message:
        message = f"{message} {PARTLY_LOADED}"
    return e if message == str(e) else CheckpointError(message)


def _detect_kind(src: Path) -> str:
    """The format of a directory without a manifest (written by hand or by another tool)."""
    return SHARDED if (src / DCP_METADATA).is_file() or (src / SHARD_INDEX).is_file() else FULL


def _load_sharded(
    runtime: Any,
    cfg: Any,
    model: nn.Module,
    optimizer: Any,
    path: Any,
    src: Path,
    meta: dict[str, Any],
    writing: _Writing,
) -> None:
    if cfg is None:
        raise CheckpointError(
            f"shardcore.load({str(path)!r}): this is a SHARDED_STATE_DICT checkpoint "
            f"(torch.distributed.checkpoint, saved by {meta.get('world_size', '?')} ranks); it loads only "
            f"into a model returned by shardcore.shard(), not into an unsharded {type(model).__name__}. "
            "Shard the model first (any world size), or load it in a sharded run and save it again with "
            "state_dict_type='FULL_STATE_DICT' to get a file any PyTorch or Transformers program reads."
        )
    sharded_checkpoints(runtime, "load", path)
    keys.check_sharded(model, src, optimizer)
    writing.started = True  # DCP copies each tensor in as it reads it
    runtime.load_sharded_state_dict(model, optimizer, str(src))
    weights_arrived(model)


def _load_full(runtime: Any, model: nn.Module, optimizer: Any, src: Path, writing: _Writing) -> None:
    """Every rank checks the file headers. A backend with SlicedLoading has every rank read only its
    own slices; otherwise only rank 0 reads tensors (every rank learns if that failed), and the
    backend spreads them."""
    files = full.weight_files(src)
    keys.check_keys(keys.expected_shapes(model), full.file_shapes(files), tied_names(model), str(src))
    opt_files = full.optimizer_files(src, optimizer)
    sliced = isinstance(runtime, SlicedLoading)
    if sliced:
        reader = full.SliceReader(files, tied_names(model))
        writing.started = True
        _every_rank_reads(runtime, lambda: runtime.load_full_slices(model, reader.fill))
    else:
        state = on_rank0(runtime, lambda: full.read_weights(files, tied_names(model)), share=False) or {}
        writing.started = True
        runtime.load_full_state_dict(model, state)
        del state  # rank 0 drops its copy of the weights before it reads the optimizer state
    weights_arrived(model)
    _load_optimizer(runtime, model, optimizer, src, opt_files)


def _load_adapter(
    runtime: Any, model: nn.Module, peft_model: Any, optimizer: Any, src: Path, writing: _Writing
) -> None:
    """An adapter directory into a (sharded) PEFT model: the file's keys and shapes checked against the
    model's adapter weights on every rank, then the model's full state with the adapter's weights in
    place of its own goes back into the model (rank 0 reads; the backend spreads)."""
    files = [inside(src, peft.ADAPTER_WEIGHTS, "the adapter weights")]
    found = full.file_shapes(files)
    shapes = keys.expected_shapes(model)
    mapping = peft.load_keys(peft_model, list(found), list(shapes), src)
    wrong = [(k, found[k], shapes[m]) for k, m in mapping.items() if tuple(found[k]) != tuple(shapes[m])]
    if wrong:
        k, a, b = wrong[0]
        raise CheckpointError(
            f"shardcore.load({str(src)!r}): adapter weight {k} has shape {tuple(a)}, the model's {tuple(b)} "
            f"({len(wrong)} such). Build the model with the adapter's LoraConfig (r, target_modules)."
        )
    opt_files = full.optimizer_files(src, optimizer)
    state = runtime.full_state_dict(model)

    def merged() -> dict[str, Any]:
        adapter = full.read_weights(files, {})
        return {**state, **{mapping[k]: v.to(state[mapping[k]].dtype) for k, v in adapter.items()}}

    new = on_rank0(runtime, merged, share=False) or {}
    writing.started = True
    runtime.load_full_state_dict(model, new)
    weights_arrived(model)
    _load_optimizer(runtime, model, optimizer, src, opt_files)


def _load_optimizer(runtime: Any, model: nn.Module, optimizer: Any, src: Path, opt_files: tuple[Path, Path]) -> None:
    if optimizer is None:
        return
    if isinstance(runtime, SlicedLoading):
        refs = full.optimizer_refs(*opt_files)
        reader = full.SliceReader([opt_files[0]], {})
        part = _every_rank_reads(runtime, lambda: runtime.read_optimizer_slices(model, refs, reader.fill))
        runtime.load_optimizer_slices(model, optimizer, part)
    else:
        osd = on_rank0(runtime, lambda: full.read_optimizer(*opt_files), share=False) or {}
        runtime.load_full_optimizer_state_dict(model, optimizer, osd)


def _every_rank_reads(runtime: Any, read: Any) -> Any:
    """Each rank reads alone, so a rank whose read fails tells the others before they go on to the
    next collective (they would wait there for it)."""
    error: BaseException | None = None
    out = None
    try:
        out = read()
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, this one re-raises it
        error = e
    failed = runtime.all_reduce_sum(torch.tensor(0.0 if error is None else 1.0, device=runtime.world().device))
    if error is not None:
        raise (
            error
            if isinstance(error, CheckpointError)
            else CheckpointError(
                f"shardcore.load: rank {runtime.world().rank} could not read its slices: {type(error).__name__}: {error}"
            )
        ) from error
    if float(failed) > 0:
        raise CheckpointError(
            f"shardcore.load: {int(float(failed))} other rank(s) could not read their slices of the checkpoint "
            "(their own error says why); this rank's model is incomplete."
        )
    return out


from .manager import CheckpointManager  # noqa: E402 - it builds on save and load above
