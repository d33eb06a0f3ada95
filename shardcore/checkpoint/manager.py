"""The checkpoint lifecycle above :func:`shardcore.save` and :func:`shardcore.load`.

A :class:`CheckpointManager` decides when a step is saved, what goes with it, which directories
count as complete, and which to delete. The anchors are torchtitan's ``CheckpointManager``
(``keep_latest_k``; ``load_step=-1`` takes the newest step that holds DCP's ``.metadata``) and
torch_xla's (``save_interval``, ``max_to_keep``, ``chkpt_on_preemption``; only directories with its
own marker are restored). The Trainer and accelerate resume from the highest-numbered folder
without a completeness check, and accelerate's ``total_limit`` deletes before the new save: both
lose runs here (transformers #35782, #35525), so this module does neither.

On disk, ``directory/step-<N>`` holds:

* ``model/``: a shardcore checkpoint of the model and the optimizer (either format);
* ``rank-<r>.json`` and ``rank-<r>.safetensors``: each rank's extra state (every object passed to
  ``save`` with ``state_dict()``) and its RNG states, as JSON and tensors, never pickle;
* ``shardcore-step.json``: the marker, written last.

The step is written into a hidden sibling and renamed into place only once every rank has written
its part and the marker is on disk. So ``step-<N>`` exists complete or not at all, and a directory
without the marker is never restored. Old steps are deleted only after the new one is in place,
each renamed away first, so a crash during retention leaves no half-deleted step behind.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal as signals
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capabilities import AsyncShardedCheckpoints
from ..errors import CheckpointError
from . import atomic, full, manifest, stage
from . import load as load_checkpoint
from .confine import read_json
from .runtime import SHARDED, on_rank0, resolve_state_dict_type, runtime_of

log = logging.getLogger(__name__)

STEP_MARKER = "shardcore-step.json"
MODEL_DIR = "model"
STEP_FORMAT_VERSION = 1
STEP_PREFIX = "step"
#: the marker's format for a CheckpointManager's step; the Trainer's checkpoints have their own
STEP_FORMAT = "shardcore-step"
TRAINER_FORMAT = "shardcore-trainer-checkpoint"
_DELETING_TAG = ".shardcore-deleting-"
#: extra-state keys that the manager writes itself
_RESERVED = frozenset({"rng"})


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step}"


class CheckpointManager:
    """Save training state every ``every`` steps (or on a signal), keep the last ``keep_last``, and
    restore the newest complete one. Collective like :func:`shardcore.save`: every rank makes the
    same calls with the same steps.

    ``state_dict_type`` is the model's format and ``async_save`` whether saves are written in the
    background (None: the config's keys of those names). ``save_on_signal`` (for example
    ``signal.SIGTERM``) installs a handler in the main thread: once any rank receives it,
    :meth:`should_save` is true on every rank at the next step, and :attr:`preempted` tells the loop
    to stop after that save.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep_last: int | None = 3,
        every: int | None = None,
        async_save: bool | None = None,
        state_dict_type: str | None = None,
        save_on_signal: int | None = None,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise CheckpointError(
                f"CheckpointManager: keep_last={keep_last!r} is not a positive integer. Pass 1 or more, or None "
                "to keep every checkpoint."
            )
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise CheckpointError(
                f"CheckpointManager: every={every!r} is not a positive integer. Pass the number of steps between "
                "saves, or None to save only when you call save() (or on save_on_signal)."
            )
        if async_save is not None and not isinstance(async_save, bool):
            raise CheckpointError(
                f"CheckpointManager: async_save={async_save!r} is not a bool. Pass True to write in the background, "
                "False, or None for the model's config key async_save."
            )
        if state_dict_type is not None:
            state_dict_type = resolve_state_dict_type(state_dict_type, None)
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.every = every
        self.async_save = async_save
        self.state_dict_type = state_dict_type
        self.preempted = False
        self._pending: Background | None = None
        self._signal: signals.Signals | None = None
        if save_on_signal is not None:
            self._install(save_on_signal)

    # ------------------------------------------------------------------------------- preemption

    def _install(self, sig: int) -> None:
        try:
            sig = signals.Signals(sig)
        except ValueError:
            raise CheckpointError(
                f"CheckpointManager: save_on_signal={sig!r} is not a signal. Pass one such as signal.SIGTERM."
            ) from None
        if not _listen(sig):
            raise CheckpointError(
                f"CheckpointManager: save_on_signal={sig.name} needs a handler installed from the main thread, and "
                "this manager is made in another thread (XLA FSDP's CPU device threads are the ranks of one "
                f"process). Call shardcore.CheckpointManager.listen(signal.{sig.name}) in the main thread before "
                "the ranks start, or create the manager in the main thread."
            )
        self._signal = sig
        log.info("shardcore: a %s saves a checkpoint at the next step", sig.name)

    @staticmethod
    def listen(sig: int) -> None:
        """Install shardcore's handler for ``sig`` from the main thread, for managers that the ranks
        create in threads of this process (XLA FSDP on CPU devices). It only records the signal;
        the managers made with ``save_on_signal=sig`` act on it."""
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("CheckpointManager.listen: call it from the main thread, before the ranks start.")
        _listen(signals.Signals(sig), user=False)

    @property
    def signal_received(self) -> bool:
        """Whether this process has received ``save_on_signal`` (on this rank only; ``should_save``
        is where the ranks agree)."""
        return self._signal is not None and _received(self._signal)

    def should_save(self, step: int, model: nn.Module | None = None) -> bool:
        """Whether ``step`` is one to save: a multiple of ``every``, or the first step after any
        rank received ``save_on_signal``. With ``save_on_signal`` this is collective (the ranks
        agree on one flag), so every rank must call it at every step, passing ``model``."""
        due = self.every is not None and step > 0 and step % self.every == 0
        if self._signal is not None:
            if model is None:
                raise CheckpointError(
                    "CheckpointManager.should_save: with save_on_signal, the ranks agree on a preemption through "
                    "the model's backend. Call should_save(step, model) on every rank."
                )
            runtime, _ = runtime_of(model)
            flag = torch.tensor([1.0 if self.signal_received else 0.0], device=runtime.world().device)
            if float(runtime.all_reduce_sum(flag).cpu()[0]) > 0:
                if not self.preempted:
                    log.warning(
                        "shardcore: %s received; saving at step %d, then the loop should stop", self._signal.name, step
                    )
                self.preempted = True
        return due or self.preempted

    # ------------------------------------------------------------------------------------- save

    def save(self, step: int, model: nn.Module, optimizer: Any = None, **state: Any) -> Path:
        """Write ``directory/step-<step>``: the model and ``optimizer`` (:func:`shardcore.save`),
        every object in ``state`` (anything with ``state_dict()`` and ``load_state_dict()``: an LR
        scheduler, a sampler, a stateful data loader), the step, and each rank's RNG states. Then
        delete the checkpoints beyond ``keep_last``. Collective; returns the directory.

        With ``async_save``, it returns once the state is in CPU memory; the write, the commit and
        the retention go on in the background. A save in flight is finished first."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(
                f"CheckpointManager.save: step={step!r} is not an integer >= 0. Pass the step number."
            )
        _check_stateful(state, "save")
        runtime, cfg = runtime_of(model)
        self._settle()
        world = runtime.world()
        final = step_dir(self.directory, step)
        asynchronous = self.async_save if self.async_save is not None else bool(cfg and cfg.async_save)
        background = asynchronous and not self.preempted  # a preempted process exits after this save
        try:
            tmp = Path(on_rank0(runtime, lambda: str(_prepare(final))))
        except BaseException as e:  # a read-only or missing directory: nothing was written yet
            raise self._failed(e, step, final, None, world.rank)
        try:
            staged = stage(
                model, tmp / MODEL_DIR, optimizer, state_dict_type=self.state_dict_type, background=background
            )
            if background and staged.kind == SHARDED and not isinstance(runtime, AsyncShardedCheckpoints):
                log.warning(
                    "shardcore: the %s backend cannot write SHARDED checkpoints in the background "
                    "(shardcore.capabilities.AsyncShardedCheckpoints); step %d was written before save returned",
                    runtime.name,
                    step,
                )
            error = _attempt(lambda: _write_rank_state(tmp, world.rank, state))
            agree(runtime, error, "writing the ranks' state")
        except BaseException as e:
            raise self._failed(e, step, final, tmp, world.rank)
        meta = {
            "format": STEP_FORMAT,
            "version": STEP_FORMAT_VERSION,
            "step": step,
            "world_size": world.size,
            "backend": runtime.name,
            "state": sorted(state),
        }

        def commit() -> None:  # rank 0, no collective: it may run in a thread
            staged.write()
            _commit(tmp, final, meta)
            log.info("shardcore: saved step %d to %s", step, final)

        if background:
            self._pending = Background(step, final, tmp, runtime, commit if world.rank == 0 else staged.wait)
            return final
        try:
            on_rank0(runtime, commit)
        except BaseException as e:
            raise self._failed(e, step, final, tmp, world.rank)
        if self.keep_last is not None:
            on_rank0(runtime, lambda: self._retain(step))
        return final

    def _failed(self, e: BaseException, step: int, final: Path, tmp: Path | None, rank: int) -> BaseException:
        """The error to raise for a save that failed: its temporary directory is gone, and the
        message names the step and the newest complete checkpoint, which is intact."""
        if rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):
            return e  # an interrupt goes on as it is
        previous = self._newest_quietly()
        kept = f" The newest complete checkpoint, {previous}, is intact." if previous else ""
        what = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        error = CheckpointError(f"CheckpointManager.save(step={step}) into {str(final)!r} failed: {what}.{kept}")
        error.__cause__ = e
        return error

    def _settle(self) -> None:
        """Finish the save in flight, if any; its error (on any rank) is raised on every rank."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = pending.join()
        if error is None and pending.runtime.world().rank == 0 and self.keep_last is not None:
            error = _attempt(lambda: self._retain(pending.step))
        try:
            agree(pending.runtime, error, f"the background save of step {pending.step}")
        except CheckpointError as e:
            raise self._failed(e, pending.step, pending.final, pending.tmp, pending.runtime.world().rank)

    def _retain(self, newest: int) -> None:
        """Delete this manager's complete steps beyond ``keep_last``; the one just written stays."""
        rotate(self.directory, STEP_PREFIX, self.checkpoints(), self.keep_last, {step_dir(self.directory, newest)})

    # ---------------------------------------------------------------------------------- restore

    def checkpoints(self) -> list[tuple[int, Path]]:
        """This manager's complete checkpoints, ``(step, path)`` oldest first (read on this rank)."""
        found, _ = scan(self.directory, STEP_PREFIX, _incomplete)
        return sorted((step, path) for step, path, _ in found)

    def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def _newest_quietly(self) -> str | None:
        try:
            latest = self.latest()
        except OSError:
            return None
        return str(latest[1]) if latest else None

    def restore(self, model: nn.Module, optimizer: Any = None, **state: Any) -> int | None:
        """Load the newest complete checkpoint into ``model``, ``optimizer`` and the objects in
        ``state`` (the same names as at save), restore each rank's RNG states, and return its step;
        None where there is none. Directories whose save did not finish are skipped, and the log
        says which and why. Collective."""
        _check_stateful(state, "restore")
        runtime, _ = runtime_of(model)
        self._settle()
        world = runtime.world()

        def choose() -> tuple[int, str, dict[str, Any]] | None:
            found, skipped = scan(self.directory, STEP_PREFIX, _incomplete)
            for path, why in skipped:
                log.warning("shardcore: not restoring %s: %s", path, why)
            if not found:
                return None
            step, path, meta = max(found)
            return step, str(path), meta

        chosen = on_rank0(runtime, choose)
        if chosen is None:
            log.info("shardcore: no complete checkpoint in %s; starting from scratch", self.directory)
            return None
        step, path, meta = chosen[0], Path(chosen[1]), chosen[2]
        saved_names = set(meta.get("state") or [])
        missing = sorted(set(state) - saved_names)
        if missing:
            raise CheckpointError(
                f"CheckpointManager.restore: {str(path)!r} (step {step}) holds no state for {missing}; it holds "
                f"{sorted(saved_names) or 'none'}. Restore without these names, or save them with the step."
            )
        for name in sorted(saved_names - set(state)):
            log.warning("shardcore: %s holds state for %r, which restore was not given; it is not restored", path, name)
        load_checkpoint(model, path / MODEL_DIR, optimizer)
        saved_world = int(meta.get("world_size", 0))
        error = _attempt(lambda: _read_rank_state(path, world.rank, world.size, saved_world, state))
        try:
            agree(runtime, error, "restoring the ranks' state")
        except CheckpointError as e:
            raise CheckpointError(f"CheckpointManager.restore: step {step} from {str(path)!r}: {e}") from e
        log.info("shardcore: restored step %d from %s", step, path)
        return step

    def wait(self) -> None:
        """Finish the save in flight, if any, and raise its error, on every rank. Collective."""
        self._settle()

    def close(self) -> None:
        """Finish the save in flight and give back the signal handler. Collective."""
        try:
            self._settle()
        finally:
            if self._signal is not None:
                _unlisten(self._signal)
                self._signal = None


class Background:
    """A save's rank-local rest (rank 0: write, commit; the others: their own SHARDED shards), in a
    thread. Not a daemon: an interpreter that exits first waits for the write."""

    def __init__(self, step: int, final: Path, tmp: Path, runtime: Any, work: Any) -> None:
        self.step, self.final, self.tmp, self.runtime = step, final, tmp, runtime
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"shardcore-save-{step}")
        self._thread.start()

    def _run(self, work: Any) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - raised at the next call on the loop's thread
            self.error = e

    def join(self) -> BaseException | None:
        self._thread.join()
        return self.error


# ------------------------------------------------------------------------------------ signals


class _SIGNALS:
    """One handler per signal for the whole process, shared by its managers: where the ranks are
    threads of one process, only the main thread may install it, and every rank must see it.

    The handler alone is not enough there. The kernel may hand a process's signal to any thread, and
    Python runs the handler in the main thread only, between two of its bytecodes. torch_xla's
    thread-per-device runner blocks the main thread until every rank returns, so a signal taken by
    a device thread stayed unseen for the whole run. The C-level handler also writes the signal's
    number to the wakeup pipe, at once, in whichever thread took it; every rank reads it there."""

    lock = threading.Lock()
    #: signal -> [the handler before shardcore's, managers using it]
    installed: dict[signals.Signals, list] = {}
    seen: set[signals.Signals] = set()
    #: (read end, write end) of the pipe set with signal.set_wakeup_fd; None where another wakeup fd
    #: was set first (asyncio's), which shardcore leaves in place
    wakeup: tuple[int, int] | None = None


def _on_signal(signum: int, frame: Any) -> None:
    # only a flag: the save itself is collective and must run in the loop, on every rank
    _SIGNALS.seen.add(signals.Signals(signum))


def _received(sig: signals.Signals) -> bool:
    with _SIGNALS.lock:
        if _SIGNALS.wakeup is not None:
            while True:
                try:
                    data = os.read(_SIGNALS.wakeup[0], 4096)
                except BlockingIOError:
                    break
                # bytes of signals shardcore does not handle (SIGINT) are Python's business, not ours
                _SIGNALS.seen.update(s for s in _SIGNALS.installed if s.value in data)
                if len(data) < 4096:
                    break
        return sig in _SIGNALS.seen


def _install_wakeup() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    previous = signals.set_wakeup_fd(w, warn_on_full_buffer=False)
    if previous != -1:  # asyncio's, or the user's: theirs stays, and the handler alone sets the flag
        signals.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return
    _SIGNALS.wakeup = (r, w)


def _close_wakeup() -> None:
    if _SIGNALS.wakeup is None:
        return
    r, w = _SIGNALS.wakeup
    _SIGNALS.wakeup = None
    previous = signals.set_wakeup_fd(-1)
    if previous != w:  # set by someone after shardcore: theirs
        signals.set_wakeup_fd(previous)
    os.close(r)
    os.close(w)


def _listen(sig: signals.Signals, user: bool = True) -> bool:
    """Install the handler (main thread) or share the one installed; False where neither can be."""
    with _SIGNALS.lock:
        entry = _SIGNALS.installed.get(sig)
        if entry is None:
            if threading.current_thread() is not threading.main_thread():
                return False
            _SIGNALS.seen.discard(sig)
            if not _SIGNALS.installed:
                _install_wakeup()
            entry = _SIGNALS.installed[sig] = [signals.signal(sig, _on_signal), 0]
        entry[1] += int(user)
        return True


def _unlisten(sig: signals.Signals) -> None:
    """A manager is done with ``sig``: the last one gives the previous handler back (from the main
    thread; a thread leaves shardcore's in place, which only records the signal)."""
    with _SIGNALS.lock:
        entry = _SIGNALS.installed.get(sig)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0 and threading.current_thread() is threading.main_thread():
            signals.signal(sig, entry[0])
            del _SIGNALS.installed[sig]
            _SIGNALS.seen.discard(sig)
            if not _SIGNALS.installed:
                _close_wakeup()


def _after_fork_in_child() -> None:
    # a forked child shares the parent's pipe, and its C-level wakeup fd is the parent's write end:
    # each would read the other's signals. It gets its own (os.fork makes the forking thread the
    # child's main thread, which may set it).
    if _SIGNALS.wakeup is not None:
        _SIGNALS.lock = threading.Lock()
        try:
            _close_wakeup()
            _install_wakeup()
        except ValueError:  # forked from a thread of a subinterpreter: the handler alone, as before
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------------------- helpers


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _check_stateful(state: dict[str, Any], verb: str) -> None:
    for name, obj in state.items():
        if name in _RESERVED:
            raise CheckpointError(
                f"CheckpointManager.{verb}: {name!r} is the name the manager gives the RNG states. Pass the object "
                "under another name."
            )
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise CheckpointError(
                f"CheckpointManager.{verb}: {name}={type(obj).__name__} has no state_dict() and load_state_dict(). "
                "Pass objects that do (an LR scheduler, a stateful data loader), or wrap the value in one."
            )


def _prepare(final: Path) -> Path:
    """Rank 0: the hidden directory the step is written into (a sibling, so the rename is atomic)."""
    if final.exists() and not (final / STEP_MARKER).is_file():
        raise CheckpointError(
            f"CheckpointManager.save: {str(final)!r} exists and was not written by a CheckpointManager (no "
            f"{STEP_MARKER}); refusing to replace it. Move it away or use another directory."
        )
    return atomic.prepare_destination(final, marker=STEP_MARKER)


def _commit(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    write_marker(tmp, meta)
    atomic.commit(tmp, final)


def _attempt(fn: Any) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every rank learns of it in agree
        return e
    return None


def agree(runtime: Any, error: BaseException | None, doing: str) -> None:
    """Every rank raises if any rank failed (a collective): no rank goes on to commit a step that
    another rank could not write."""
    world = runtime.world()
    failed = torch.tensor([0.0 if error is None else 1.0], device=world.device)
    failures = int(float(runtime.all_reduce_sum(failed).cpu()[0]))
    if error is not None:
        raise CheckpointError(f"{doing}, rank {world.rank} failed: {type(error).__name__}: {error}") from error
    if failures:
        raise CheckpointError(f"{doing}, {failures} other rank(s) failed; their errors say why")


def scan(
    directory: Path, prefix: str, incomplete: Any
) -> tuple[list[tuple[int, Path, dict[str, Any]]], list[tuple[Path, str]]]:
    """The complete ``<prefix>-<N>`` directories as ``(N, path, marker)``, and those that are not,
    each with the reason. ``incomplete(path, N, marker)`` says what else a complete one holds."""
    found: list[tuple[int, Path, dict[str, Any]]] = []
    skipped: list[tuple[Path, str]] = []
    if not directory.is_dir():
        return found, skipped
    name = re.compile(rf"{re.escape(prefix)}-(\d+)")
    for p in directory.iterdir():
        m = name.fullmatch(p.name)
        if m is None or not p.is_dir() or p.is_symlink():
            continue
        step = int(m.group(1))
        meta, why = read_marker(p, step, STEP_FORMAT if prefix == STEP_PREFIX else TRAINER_FORMAT)
        if why is None:
            why = incomplete(p, step, meta)
        if why is None:
            found.append((step, p, meta))
        else:
            skipped.append((p, why))
    for p in directory.glob(f".{prefix}-*{atomic.TMP_TAG}*"):
        skipped.append((p, "a save that did not finish (its temporary directory)"))
    return found, skipped


def read_marker(path: Path, step: int, fmt: str) -> tuple[dict[str, Any], str | None]:
    """``path``'s marker, and why it does not mark ``path`` as a complete save of ``step`` (None if it does)."""
    if not (path / STEP_MARKER).is_file():
        return {}, f"no {STEP_MARKER}, so its save did not finish, or shardcore did not write it"
    try:
        meta = read_json(path, STEP_MARKER, "the step marker")
    except CheckpointError as e:
        return {}, str(e)
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        return {}, f"its {STEP_MARKER} is not a marker of format {fmt!r}"
    if meta.get("version") != STEP_FORMAT_VERSION:
        return (
            meta,
            f"its {STEP_MARKER} has version {meta.get('version')!r}; this shardcore reads {STEP_FORMAT_VERSION}",
        )
    if meta.get("step") != step:
        return meta, f"its {STEP_MARKER} says step {meta.get('step')!r}, not {step}"
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1:
        return meta, f"its {STEP_MARKER} has world_size {world!r}"
    return meta, None


def write_marker(path: Path, meta: dict[str, Any]) -> None:
    """Mark ``path`` complete: the marker appears whole or not at all, after everything else."""
    part = path / f".{STEP_MARKER}{atomic.TMP_TAG}{uuid.uuid4().hex[:8]}"
    part.write_text(json.dumps({"version": STEP_FORMAT_VERSION, **meta}, indent=2) + "\n")
    atomic.fsync(part)
    os.replace(part, path / STEP_MARKER)
    atomic.fsync(path)


def rotate(directory: Path, prefix: str, complete: list, keep: int | None, protected: set[Path]) -> None:
    """Delete the oldest of the ``complete`` checkpoints (``(N, path, ...)``) until ``keep`` are left,
    never one in ``protected`` (the Trainer's rule: ``max(keep, len(protected))`` stay). Only complete
    checkpoints are counted or deleted, so a save in progress or a directory shardcore did not write
    is never touched, and neither is the newest complete one. Each is renamed away first: an
    interrupted delete leaves no partial one."""
    if keep is not None and complete:
        complete = sorted(complete, key=lambda c: c[0])
        # the newest by step too: after a run resumed from an older step, it is what a resume picks
        protected = {Path(p) for p in protected} | {complete[-1][1]}
        left = len(complete)
        for entry in complete:
            victim = entry[1]
            if left <= max(keep, len(protected)):
                break
            if victim in protected:
                continue
            if discard(victim):
                left -= 1
                log.info("shardcore: deleted old checkpoint %s (keeping %d)", victim, keep)
    for leftover in directory.glob(f".{prefix}-*{_DELETING_TAG}*"):  # a delete that was killed
        _remove(leftover)


def discard(path: Path) -> bool:
    """Delete a checkpoint directory, renamed away first so that no partial one is ever seen under
    its name. False (with a warning) where it cannot be renamed."""
    doomed = path.parent / f".{path.name}{_DELETING_TAG}{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, doomed)
    except OSError as e:
        log.warning("shardcore: could not delete checkpoint %s (%s); it stays", path, e)
        return False
    _remove(doomed)
    return True


def _incomplete(path: Path, step: int, meta: dict[str, Any]) -> str | None:
    """Why the marked ``path`` is not a complete step, or None."""
    if not manifest.is_checkpoint(path / MODEL_DIR):
        return f"it has no complete model checkpoint ({MODEL_DIR}/{manifest.MANIFEST} missing)"
    missing = [r for r in range(meta["world_size"]) if not (path / f"{_rank_name(r)}.json").is_file()]
    if missing:
        return f"the state of rank(s) {missing[:4]} is missing"
    return None


def _rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _write_rank_state(tmp: Path, rank: int, state: dict[str, Any]) -> None:
    objects = {name: obj.state_dict() for name, obj in sorted(state.items())}
    objects["rng"] = _rng_state()
    name = _rank_name(rank)
    full.write_encoded(objects, tmp / f"{name}.safetensors", tmp / f"{name}.json", "extra state")


def _read_rank(path: Path, rank: int) -> dict[str, Any]:
    return full.read_optimizer(
        path / f"{_rank_name(rank)}.safetensors", path / f"{_rank_name(rank)}.json", "extra state"
    )


def _read_rank_state(path: Path, rank: int, size: int, saved_size: int, state: dict[str, Any]) -> None:
    if size == saved_size:
        objects = _read_rank(path, rank)
        for name, obj in state.items():
            obj.load_state_dict(objects[name])
        _set_rng_state(objects["rng"])
        return
    # Another world size: an object whose state was the same on every rank loads everywhere; one that
    # differed (a per-rank data position) cannot be mapped onto other ranks, and is refused.
    saved = [_read_rank(path, r) for r in range(saved_size)]
    for name, obj in state.items():
        first = saved[0][name]
        if any(not _same(first, other[name]) for other in saved[1:]):
            raise CheckpointError(
                f"the state of {name!r} differs between the {saved_size} ranks that saved it (per-rank state such as a "
                f"data position), and this run has {size} ranks, so no rank's state is this rank's. Restore at "
                f"{saved_size} ranks, or restore without {name}= and start it afresh."
            )
        obj.load_state_dict(first)
    log.warning(
        "shardcore: %s was saved by %d ranks and this run has %d; the RNG states are per rank, so they are not restored",
        path,
        saved_size,
        size,
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from on this rank (dropout, shuffling, sampling)."""
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        rng["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos)}
        rng["numpy"].update(has_gauss=int(has_gauss), cached=float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    xm = _xla_model()
    if xm is not None:
        rng["xla"] = int(xm.get_rng_state())
    return rng


def _set_rng_state(rng: dict[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(rng["torch"])
    np = _numpy()
    if np is not None and "numpy" in rng:
        n = rng["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))
    xm = _xla_model()
    if xm is not None and "xla" in rng:
        xm.set_rng_state(rng["xla"])


def _numpy() -> Any:
    import sys

    return sys.modules.get("numpy")


def _xla_model() -> Any:
    """torch_xla's RNG, only in an XLA run: one whose XLA runtime has started. Imported is not
    enough: Transformers imports torch_xla wherever it is installed, and torch_xla's RNG then raises
    "$PJRT_DEVICE is not set" in a plain PyTorch run."""
    import sys

    if "torch_xla" not in sys.modules:
        return None
    import torch_xla

    if not torch_xla._XLAC._xla_runtime_is_initialized():
        return None
    import torch_xla.core.xla_model as xm

    return xm
