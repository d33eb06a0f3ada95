"""CheckpointManager in one process (a plain model, FULL format): what goes with a step, exact
resumption, retention, which directories restore picks and skips, preemption by signal, and a
failed save that leaves the previous step intact. Multi-rank runs: test_checkpoint_manager_ranks.py.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import sys

import numpy as np
import pytest
import torch

import shardcore
from shardcore.checkpoint import manager as mgr
from shardcore_conformance.models import MLP


class Position:
    """A stateful data position, as a sampler or a stateful data loader keeps one."""

    def __init__(self) -> None:
        self.index = 0
        self.seen: list[int] = []

    def state_dict(self) -> dict:
        return {"index": self.index, "seen": list(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.index, self.seen = state["index"], list(state["seen"])


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, Position()


def _step(model, opt, sched, pos) -> float:
    # every generator a loop may draw from: torch (dropout, init), python (shuffles), numpy
    x = torch.randn(4, 13) + random.random() + float(np.random.rand())
    x = torch.nn.functional.dropout(x, 0.3)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    pos.index += 4
    pos.seen.append(pos.index)
    return loss.item()


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resuming_from_the_manager_continues_bit_for_bit(tmp_path):
    """Six steps straight equal three, save, a new model built with another seed, restore, three:
    the model, AdamW, the LR scheduler, a data position and the RNG states all come back."""
    _seed_all(0)
    straight = _setup()
    losses = [_step(*straight) for _ in range(6)]

    _seed_all(0)
    first = _setup()
    head = [_step(*first) for _ in range(3)]
    manager = shardcore.CheckpointManager(tmp_path / "ckpt")
    manager.save(3, first[0], first[1], scheduler=first[2], data=first[3])

    _seed_all(123)
    model, opt, sched, pos = _setup(seed=7)
    assert manager.restore(model, opt, scheduler=sched, data=pos) == 3
    tail = [_step(model, opt, sched, pos) for _ in range(3)]
    assert head + tail == losses
    for a, b in zip(model.parameters(), straight[0].parameters()):
        assert torch.equal(a, b)
    assert pos.state_dict() == straight[3].state_dict()
    assert sched.state_dict() == straight[2].state_dict()
    on_disk = sorted(p.name for p in (tmp_path / "ckpt" / "step-3").iterdir())
    assert on_disk == ["model", "rank-00000.json", "rank-00000.safetensors", "shardcore-step.json"]


@pytest.mark.xla
def test_a_plain_run_that_imported_torch_xla_saves_and_resumes(tmp_path, monkeypatch):
    """Transformers imports torch_xla wherever it is installed. A run on a torch device then has
    torch_xla imported and no XLA runtime: its RNG state is not the run's to save."""
    import torch_xla.core.xla_model  # noqa: F401

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    _seed_all(0)
    model, opt, sched, pos = _setup()
    _step(model, opt, sched, pos)
    manager = shardcore.CheckpointManager(tmp_path / "ckpt")
    manager.save(1, model, opt, scheduler=sched, data=pos)
    model, opt, sched, pos = _setup(seed=7)
    assert manager.restore(model, opt, scheduler=sched, data=pos) == 1


def test_restore_without_a_checkpoint_returns_none(tmp_path):
    model, opt, *_ = _setup()
    before = [p.clone() for p in model.parameters()]
    assert shardcore.CheckpointManager(tmp_path / "none").restore(model, opt) is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_retention_keeps_the_last_k_and_never_touches_what_it_did_not_write(tmp_path):
    root = tmp_path / "ckpt"
    (root / "step-1000").mkdir(parents=True)  # not the manager's: no marker
    (root / "step-1000" / "notes.txt").write_text("mine")
    (root / "logs").mkdir()
    model, opt, *_ = _setup()
    manager = shardcore.CheckpointManager(root, keep_last=2)
    for step in range(1, 6):
        manager.save(step, model, opt)
    assert [s for s, _ in manager.checkpoints()] == [4, 5]
    assert sorted(p.name for p in root.iterdir()) == ["logs", "step-1000", "step-4", "step-5"]
    assert (root / "step-1000" / "notes.txt").read_text() == "mine"


def test_saving_a_step_again_replaces_it_in_one_piece(tmp_path):
    model, opt, sched, pos = _setup()
    manager = shardcore.CheckpointManager(tmp_path, keep_last=None)
    manager.save(2, model, opt, data=pos)
    pos.index = 99
    manager.save(2, model, opt, data=pos)
    fresh = Position()
    assert manager.restore(model, opt, data=fresh) == 2 and fresh.index == 99
    assert [p.name for p in tmp_path.iterdir()] == ["step-2"]


def test_restore_takes_the_newest_complete_step_and_says_what_it_skipped(tmp_path, caplog):
    model, opt, sched, pos = _setup()
    manager = shardcore.CheckpointManager(tmp_path, keep_last=None)
    manager.save(4, model, opt, data=pos)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(6, model, opt, data=pos)
    # a save killed before its marker, one whose model part is missing, and an unfinished temporary
    shutil.copytree(tmp_path / "step-6", tmp_path / "step-8")
    (tmp_path / "step-8" / mgr.STEP_MARKER).unlink()
    shutil.copytree(tmp_path / "step-6", tmp_path / "step-7")
    meta = json.loads((tmp_path / "step-7" / mgr.STEP_MARKER).read_text())
    (tmp_path / "step-7" / mgr.STEP_MARKER).write_text(json.dumps({**meta, "step": 7}))
    shutil.rmtree(tmp_path / "step-7" / "model")
    (tmp_path / ".step-9.shardcore-tmp-0123456789ab").mkdir()
    # step 6 damaged in its rank file: the marker is there, the rank state is not
    (tmp_path / "step-6" / "rank-00000.json").unlink()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with caplog.at_level(logging.WARNING, logger="shardcore"):
        assert manager.restore(model, opt, data=Position()) == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.items())
    log = caplog.text
    assert "step-8: no shardcore-step.json" in log
    assert "step-7: it has no complete model checkpoint" in log
    assert "step-6: the state of rank(s) [0] is missing" in log
    assert ".step-9.shardcore-tmp-0123456789ab: a save that did not finish" in log


def test_should_save_every_n_steps(tmp_path):
    manager = shardcore.CheckpointManager(tmp_path, every=3)
    assert [s for s in range(10) if manager.should_save(s)] == [3, 6, 9]
    assert not any(shardcore.CheckpointManager(tmp_path).should_save(s) for s in range(10))


def test_a_signal_makes_the_next_step_save_and_marks_the_run_preempted(tmp_path):
    model, *_ = _setup()
    before = signal.getsignal(signal.SIGUSR1)
    manager = shardcore.CheckpointManager(tmp_path, every=100, save_on_signal=signal.SIGUSR1)
    try:
        assert not manager.should_save(1, model) and not manager.preempted
        os.kill(os.getpid(), signal.SIGUSR1)
        assert manager.should_save(2, model) and manager.preempted
        with pytest.raises(shardcore.CheckpointError, match=r"should_save\(step, model\)"):
            manager.should_save(3)
    finally:
        manager.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_managers_in_threads_share_the_handler_the_main_thread_installs(tmp_path):
    """Where the ranks are threads of one process (XLA FSDP on CPU devices), a manager made in a
    thread cannot install a handler: it says how to, and with listen() every thread's manager sees
    the signal."""
    import threading
    import time

    model, *_ = _setup()
    before = signal.getsignal(signal.SIGUSR2)
    errors, seen = [], []

    def rank(i):
        try:
            manager = shardcore.CheckpointManager(tmp_path / str(i), every=100, save_on_signal=signal.SIGUSR2)
        except shardcore.CheckpointError as e:
            errors.append(str(e))
            return
        barrier.wait()  # every manager made
        if i == 0:
            os.kill(os.getpid(), signal.SIGUSR2)
        while not manager.signal_received:  # the main thread runs the handler, between its bytecodes
            time.sleep(0.001)
        seen.append(manager.should_save(1, model))
        manager.close()

    def run():
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.01)  # the main thread must run to execute the handler

    barrier = threading.Barrier(2)
    run()
    assert len(errors) == 2 and "CheckpointManager.listen(signal.SIGUSR2) in the main thread" in errors[0], errors
    errors.clear()
    shardcore.CheckpointManager.listen(signal.SIGUSR2)
    try:
        run()
        assert errors == [] and seen == [True, True]
    finally:
        mgr._unlisten(signal.SIGUSR2)
    assert signal.getsignal(signal.SIGUSR2) == before


def test_a_signal_a_rank_thread_takes_is_seen_while_the_main_thread_waits(tmp_path):
    """torch_xla's thread-per-device runner blocks the main thread until every rank returns, and
    Python runs signal handlers in the main thread only. The kernel may hand the signal to a device
    thread (here pthread_kill makes it): every rank still sees it, while the main thread waits."""
    import concurrent.futures
    import threading
    import time

    before = signal.getsignal(signal.SIGUSR2)
    barrier = threading.Barrier(2)
    main = threading.main_thread()

    def main_blocked() -> bool:
        # asleep in Condition.wait's lock acquire, which runs no bytecode, so no handler, until it returns
        frame = sys._current_frames().get(main.ident)
        with open(f"/proc/self/task/{main.native_id}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return frame is not None and frame.f_code.co_name == "wait" and state == "S"

    def rank(i):
        manager = shardcore.CheckpointManager(tmp_path / str(i), every=100, save_on_signal=signal.SIGUSR2)
        try:
            barrier.wait()
            if i == 0:
                deadline = time.monotonic() + 10
                while not main_blocked() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert main_blocked(), "the main thread never waited for the ranks"
                signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
            deadline = time.monotonic() + 5
            while not manager.signal_received and time.monotonic() < deadline:
                time.sleep(0.001)
            return manager.signal_received
        finally:
            manager.close()

    shardcore.CheckpointManager.listen(signal.SIGUSR2)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as ranks:
            seen = list(ranks.map(rank, range(2)))  # the main thread blocks here, as in torch_xla's runner
        assert seen == [True, True]
    finally:
        mgr._unlisten(signal.SIGUSR2)
    assert signal.getsignal(signal.SIGUSR2) == before
    assert signal.set_wakeup_fd(-1) == -1, "the last manager closed, and shardcore's wakeup pipe is still set"


@pytest.mark.multiprocess
def test_a_forked_childs_signal_is_not_its_parents(tmp_path):
    """A fork inherits the wakeup pipe's descriptors: without a pipe of its own, the child's signal
    would reach the parent's managers."""
    before = signal.getsignal(signal.SIGUSR2)
    manager = shardcore.CheckpointManager(tmp_path, every=100, save_on_signal=signal.SIGUSR2)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.kill(os.getpid(), signal.SIGUSR2)
                # its own pipe, and the C-level wakeup fd writes there
                own = mgr._SIGNALS.wakeup
                code = 0 if own is not None and signal.set_wakeup_fd(own[1]) == own[1] else 2
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the child has no wakeup pipe of its own"
        assert not manager.signal_received, "the child's SIGUSR2 reached the parent's manager"
        os.kill(os.getpid(), signal.SIGUSR2)
        assert manager.signal_received
    finally:
        manager.close()
    assert signal.getsignal(signal.SIGUSR2) == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep_last": 0}, r"keep_last=0 is not a positive integer"),
        ({"every": 0}, r"every=0 is not a positive integer"),
        ({"every": True}, r"every=True is not a positive integer"),
        ({"async_save": "yes"}, r"async_save='yes' is not a bool"),
        ({"state_dict_type": "PICKLE"}, r"state_dict_type"),
        ({"save_on_signal": 12345}, r"save_on_signal=12345 is not a signal"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, match):
    with pytest.raises(shardcore.ShardcoreError, match=match):
        shardcore.CheckpointManager(tmp_path, **kwargs)


def test_bad_save_and_restore_arguments_are_refused_by_name(tmp_path):
    model, opt, *_ = _setup()
    manager = shardcore.CheckpointManager(tmp_path)
    with pytest.raises(shardcore.CheckpointError, match=r"step=-1 is not an integer >= 0"):
        manager.save(-1, model, opt)
    with pytest.raises(shardcore.CheckpointError, match=r"data=int has no state_dict\(\) and load_state_dict\(\)"):
        manager.save(1, model, opt, data=5)
    with pytest.raises(shardcore.CheckpointError, match=r"'rng' is the name the manager gives the RNG states"):
        manager.save(1, model, opt, rng=Position())
    manager.save(1, model, opt, data=Position())
    with pytest.raises(shardcore.CheckpointError, match=r"holds no state for \['other'\]; it holds \['data'\]"):
        manager.restore(model, opt, other=Position())
    assert not list(tmp_path.glob(".step-*"))


def test_state_that_needs_pickle_is_refused_before_anything_is_committed(tmp_path):
    class Odd(Position):
        def state_dict(self):
            return {"when": object()}

    model, opt, *_ = _setup()
    manager = shardcore.CheckpointManager(tmp_path)
    with pytest.raises(shardcore.CheckpointError, match=r"extra state '/odd/when' is a object.*without pickle"):
        manager.save(1, model, opt, odd=Odd())
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    import safetensors.torch

    model, opt, sched, pos = _setup()
    manager = shardcore.CheckpointManager(tmp_path)
    manager.save(1, model, opt, data=pos)
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        if "rank-" in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(shardcore.CheckpointError) as e:
        manager.save(2, model, opt, data=pos)
    message = str(e.value)
    assert "CheckpointManager.save(step=2)" in message and "No space left on device" in message
    assert f"The newest complete checkpoint, {tmp_path / 'step-1'}, is intact." in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    assert manager.restore(model, opt, data=Position()) == 1


def _read_only_tmpfs(path):
    """Mount a tmpfs at ``path``; returns ``(make_read_only, unmount)``, or None where this process
    may not mount (it needs CAP_SYS_ADMIN, as root in a container has). A chmod would not do: root
    writes through it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_rdonly, ms_remount = 1, 32
    path.mkdir()
    if libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, b"size=16m") != 0:
        return None

    def make_read_only():
        assert libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", ms_remount | ms_rdonly, None) == 0, ctypes.get_errno()

    return make_read_only, lambda: libc.umount2(str(path).encode(), 2)  # MNT_DETACH


def test_a_read_only_directory_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    """A real read-only file system (a tmpfs remounted read-only) where it can be mounted; the error
    it raises (EROFS) injected where it cannot."""
    model, opt, sched, pos = _setup()
    where = tmp_path / "ckpt"
    mounted = _read_only_tmpfs(where)
    try:
        manager = shardcore.CheckpointManager(where)
        manager.save(1, model, opt, data=pos)
        _step(model, opt, sched, pos)
        if mounted:
            mounted[0]()
        else:
            logging.getLogger(__name__).warning("no permission to mount a tmpfs here: EROFS is injected")
            real_mkdir = type(where).mkdir

            def read_only(self, *a, **k):
                if where in self.parents:
                    raise OSError(errno.EROFS, "Read-only file system", str(self))
                return real_mkdir(self, *a, **k)

            monkeypatch.setattr(type(where), "mkdir", read_only)
        with pytest.raises(shardcore.CheckpointError) as e:
            manager.save(2, model, opt, data=pos)
        message = str(e.value)
        assert "Read-only file system" in message and "step=2" in message, message
        assert f"The newest complete checkpoint, {where / 'step-1'}, is intact." in message, message
        assert sorted(p.name for p in where.iterdir()) == ["step-1"]
        fresh, fresh_opt, _, fresh_pos = _setup(seed=1)
        assert shardcore.CheckpointManager(where).restore(fresh, fresh_opt, data=fresh_pos) == 1
        assert fresh_pos.index == 0
    finally:
        if mounted:
            mounted[1]()


def test_a_directory_that_cannot_be_written_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model, opt, *_ = _setup()
    with pytest.raises(shardcore.CheckpointError, match=r"cannot create a directory beside"):
        shardcore.CheckpointManager(blocker / "ckpt").save(1, model, opt)


def test_a_foreign_directory_named_like_a_step_is_not_replaced(tmp_path):
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "data.bin").write_bytes(b"x")
    model, opt, *_ = _setup()
    with pytest.raises(shardcore.CheckpointError, match=r"not written by a CheckpointManager"):
        shardcore.CheckpointManager(tmp_path).save(3, model, opt)
    assert (tmp_path / "step-3" / "data.bin").read_bytes() == b"x"


def test_interrupted_retention_leaves_only_whole_steps(tmp_path, monkeypatch):
    """A delete killed half-way (rmtree raising after the rename) leaves a hidden directory that the
    next retention removes, never a partial step-<N> that restore would choose."""
    model, opt, *_ = _setup()
    manager = shardcore.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, model, opt)

    def dies(path):
        raise KeyboardInterrupt  # stands in for a kill in the middle of the delete

    with monkeypatch.context() as m:
        m.setattr(mgr, "_remove", dies)
        with pytest.raises(KeyboardInterrupt):
            manager.save(2, model, opt)
    assert [s for s, _ in manager.checkpoints()] == [2]
    assert len(list(tmp_path.glob(".step-1.shardcore-deleting-*"))) == 1
    assert manager.restore(model, opt) == 2
    manager.save(3, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


#: phase -> (module, function) an interrupt lands in, in a save's order (workers/ckpt_manager.py
#: kills real ranks at the same points)
_SAVE_PHASES = {
    "staging": ("manifest", "build_manifest"),
    "rank_state": ("full", "write_encoded"),
    "model_commit": ("full", "write_full"),
    "marker": ("mgr", "_commit"),
}


@pytest.mark.parametrize("phase", list(_SAVE_PHASES))
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_interrupted_at_any_phase_leaves_the_previous_step_to_restore(tmp_path, monkeypatch, phase, async_save):
    """The fast tier's kill points: an interrupt in each phase of the save of step 2 (in the
    background thread for an async save) leaves step 1 as the newest complete step, which restores,
    and the next save of step 2 completes."""
    model, opt, *_ = _setup()
    manager = shardcore.CheckpointManager(tmp_path, keep_last=2, async_save=async_save)
    manager.save(1, model, opt)
    manager.wait()
    owner, name = _SAVE_PHASES[phase]
    module = {"manifest": shardcore.checkpoint.manifest, "full": shardcore.checkpoint.full, "mgr": mgr}[owner]

    def dies(*a, **k):
        raise KeyboardInterrupt  # stands in for a kill at this point

    with monkeypatch.context() as m:
        m.setattr(module, name, dies)
        with pytest.raises((KeyboardInterrupt, shardcore.CheckpointError)):
            manager.save(2, model, opt)
            manager.wait()  # an async save's interrupt ends its thread; the error comes here
    assert [s for s, _ in manager.checkpoints()] == [1]
    fresh, fresh_opt, *_ = _setup(seed=5)
    assert manager.restore(fresh, fresh_opt) == 1
    manager.save(2, model, opt)
    manager.close()
    assert [s for s, _ in manager.checkpoints()] == [1, 2]


def test_restore_at_another_world_size_loads_shared_state_and_refuses_per_rank_state(tmp_path, caplog):
    """Written as if by two ranks: state that was the same on both loads on one; state that
    differed (a per-rank data position) is refused by name; the RNG states are not restored."""
    model, opt, sched, pos = _setup()
    manager = shardcore.CheckpointManager(tmp_path)
    manager.save(5, model, opt, scheduler=sched, data=pos)
    step = tmp_path / "step-5"
    meta = json.loads((step / mgr.STEP_MARKER).read_text())
    (step / mgr.STEP_MARKER).write_text(json.dumps({**meta, "world_size": 2}))
    for ext in ("json", "safetensors"):
        shutil.copy(step / f"rank-00000.{ext}", step / f"rank-00001.{ext}")
    torch.manual_seed(55)
    rng = torch.get_rng_state()
    sched2 = torch.optim.lr_scheduler.StepLR(opt, step_size=9)
    with caplog.at_level(logging.WARNING, logger="shardcore"):
        assert manager.restore(model, opt, scheduler=sched2) == 5
    assert sched2.state_dict()["step_size"] == 2
    assert torch.equal(torch.get_rng_state(), rng)
    assert "saved by 2 ranks and this run has 1; the RNG states are per rank, so they are not restored" in caplog.text

    pos.index = 1000  # rank 1's position now differs from rank 0's
    mgr.full.write_encoded(
        {"data": pos.state_dict(), "scheduler": sched.state_dict(), "rng": mgr._rng_state()},
        step / "rank-00001.safetensors",
        step / "rank-00001.json",
        "extra state",
    )
    with pytest.raises(shardcore.CheckpointError, match=r"the state of 'data' differs between the 2 ranks"):
        manager.restore(model, opt, scheduler=sched2, data=Position())


# ------------------------------------------------------------------------------------ async_save


def _blocked_writer(monkeypatch):
    """Hold the background writer of FULL files until the test releases it."""
    import threading

    release, started = threading.Event(), threading.Event()
    real = shardcore.checkpoint.full.write_full

    def held(*a, **k):
        started.set()
        assert release.wait(60), "the test never released the writer"
        return real(*a, **k)

    monkeypatch.setattr(shardcore.checkpoint.full, "write_full", held)
    return release, started


def test_async_save_returns_before_the_write_and_keeps_the_state_it_was_given(tmp_path, monkeypatch):
    """save() returns while the write is held; training then changes the parameters in place; the
    checkpoint still holds the state of the step it was saved at (the staging copy)."""
    release, started = _blocked_writer(monkeypatch)
    model, opt, sched, pos = _setup()
    manager = shardcore.CheckpointManager(tmp_path, async_save=True)
    _step(model, opt, sched, pos)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    manager.save(1, model, opt, scheduler=sched, data=pos)
    assert started.wait(60)
    assert not (tmp_path / "step-1").exists() and manager.checkpoints() == []
    for _ in range(2):
        _step(model, opt, sched, pos)  # in place, while the writer holds the step's state
    release.set()
    manager.wait()
    assert [s for s, _ in manager.checkpoints()] == [1]
    fresh, fresh_opt, fresh_sched, fresh_pos = _setup(seed=3)
    assert manager.restore(fresh, fresh_opt, scheduler=fresh_sched, data=fresh_pos) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    assert fresh_pos.index == 4 and fresh_sched.last_epoch == 1


@pytest.mark.parametrize(
    "config, manager_says, background", [(True, None, True), (False, None, False), (True, False, False)]
)
def test_the_config_key_async_save_is_the_managers_default(tmp_path, monkeypatch, config, manager_says, background):
    """A sharded model's ``async_save`` key decides when the manager is not told; the manager's own
    argument wins over it."""
    release, started = _blocked_writer(monkeypatch)
    model = shardcore.shard(_setup()[0], {"auto_wrap_policy": "NO_WRAP", "async_save": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = shardcore.CheckpointManager(tmp_path, async_save=manager_says)
    if not background:
        release.set()
    manager.save(1, model, opt)
    assert started.is_set() if not background else started.wait(60)
    assert (tmp_path / "step-1").exists() is not background
    release.set()
    manager.close()
    assert [s for s, _ in manager.checkpoints()] == [1]


def test_async_save_finishes_the_one_in_flight_before_the_next_and_on_close_and_restore(tmp_path, monkeypatch):
    release, started = _blocked_writer(monkeypatch)
    release.set()
    model, opt, *_ = _setup()
    manager = shardcore.CheckpointManager(tmp_path, keep_last=2, async_save=True)
    for step in (1, 2, 3):
        manager.save(step, model, opt)
    manager.close()
    assert [s for s, _ in manager.checkpoints()] == [2, 3]
    manager.save(4, model, opt)
    assert manager.restore(model, opt) == 4
    assert [s for s, _ in manager.checkpoints()] == [3, 4]


def test_an_error_in_the_background_surfaces_at_the_next_call_naming_the_step(tmp_path, monkeypatch):
    model, opt, *_ = _setup()
    manager = shardcore.CheckpointManager(tmp_path, async_save=True)
    manager.save(1, model, opt)
    manager.wait()

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shardcore.checkpoint.full, "write_full", full_disk)
    manager.save(2, model, opt)  # returns: the write fails in the background
    with pytest.raises(shardcore.CheckpointError) as e:
        manager.save(3, model, opt)
    message = str(e.value)
    assert "the background save of step 2" in message and "No space left on device" in message
    assert f"The newest complete checkpoint, {tmp_path / 'step-1'}, is intact." in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    monkeypatch.undo()
    manager.save(3, model, opt)
    manager.close()
    assert [s for s, _ in manager.checkpoints()] == [1, 3]
