"""``ckpt_manager.py DIR KIND MODE [POINT]``: the fixed schedule (STEPS steps) under a
CheckpointManager in ``DIR/ckpt`` (KIND checkpoints every 2 steps, the last 2 kept; MODE ``sync`` or
``async`` saves), resumed first from the newest complete step. Rank 0 writes ``DIR/result.pt``: the
step it resumed from and the final state.

POINT ``phase:step:who`` SIGKILLs rank ``who`` (or ``all``: each rank that gets there) at ``phase``
of step ``step`` (see :data:`PHASES`); the test restarts the job without POINT. ``sigterm:step:who``
sends that rank a SIGTERM after the backward of step ``step`` instead: the manager saves at the next
step on every rank and the job stops, rank 0 writing ``DIR/preempted.pt`` with the step saved.
"""

import os
import re
import signal
import sys
from pathlib import Path

import torch

import shardcore
import shardcore.checkpoint as ckpt
from shardcore.checkpoint import manager as mgr

from ckpt_common import STEPS, backend, full, loss_fn, make_batches, rank, run, sharded, write

#: where a kill can land, in the order a step meets them (with async saves, from model_commit on
#: in rank 0's background thread, retention at the next save)
PHASES = (
    "train",  # after the backward of step ``step`` (a sync save is done; an async one may be in flight)
    "staging",  # a save starts: nothing of the model gathered or written yet
    "rank_state",  # the model staged (SHARDED: written, or being written); this rank's extra state next
    "model_commit",  # the model's files written, not yet moved into the step's directory (rank 0)
    "marker",  # every rank's part written; the step's marker next (rank 0)
    "rename",  # the marker written; the step not yet renamed into place (rank 0)
    "retention",  # the step in place; an old one renamed away, being deleted (rank 0)
)


class Counter:
    """Stateful extra state: the number of batches seen, as a data loader would keep it."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


def arm(point: str, saving: dict) -> tuple[str, int]:
    """Patch the kill into the checkpoint code; returns (phase, step) for the training loop."""
    phase, step, who = point.split(":")
    step = int(step)
    if phase not in (*PHASES, "sigterm"):
        raise SystemExit(f"unknown phase {phase!r}")
    if who != "all" and int(who) != int(os.environ.get("RANK", "0")):  # before the process group exists
        return "", -1

    def die() -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def at(module, name: str, step_of=lambda *a, **k: saving.get("step")) -> None:
        real = getattr(module, name)

        def hooked(*a, **k):
            if step_of(*a, **k) == step:
                die()
            return real(*a, **k)

        setattr(module, name, hooked)

    # The phases an async save reaches in its background thread name their step by their paths:
    # the loop may have begun the next save (saving["step"]) before the thread gets there.
    if phase == "staging":
        at(ckpt.manifest, "build_manifest")
    elif phase == "model_commit":
        at(ckpt.atomic, "commit", lambda tmp, final: step_named(final.parent) if final.name == mgr.MODEL_DIR else None)
    elif phase == "rank_state":
        at(mgr.full, "write_encoded")
    elif phase == "marker":
        at(mgr, "_commit", lambda tmp, final, meta: meta["step"])
    elif phase == "rename":
        at(ckpt.atomic, "commit", lambda tmp, final: step_named(final))
    elif phase == "retention":
        at(mgr, "_remove")
    return phase, step


def step_named(path: Path) -> int | None:
    """The step of a manager's step directory, final (``step-4``) or being written (``.step-4.<tag>``)."""
    found = re.fullmatch(r"\.?step-(\d+)(\..*)?", path.name)
    return int(found[1]) if found else None


def train(d: Path, kind: str, mode: str, point: str | None = None) -> None:
    saving: dict = {}
    kill_phase, kill_step = arm(point, saving) if point else ("", -1)
    model, opt = sharded()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter()
    manager = shardcore.CheckpointManager(
        d / "ckpt",
        keep_last=2,
        every=2,
        state_dict_type=kind,
        async_save={"sync": False, "async": True}[mode],
        save_on_signal=signal.SIGTERM,
    )
    real_save = manager.save

    def save(step, *a, **k):
        saving["step"] = step
        return real_save(step, *a, **k)

    manager.save = save
    start = manager.restore(model, opt, scheduler=sched, data=counter) or 0
    assert counter.batches == start, (counter.batches, start)
    print(f"rank {rank()} restored step {start}", flush=True)
    rt = backend(model)
    batches = make_batches("llama", STEPS, 8, 0)
    for step in range(start, STEPS):
        loss = loss_fn("llama", model, rt.local_batch(batches[step]))
        loss.backward()
        if step == kill_step and kill_phase in ("train", "sigterm"):
            os.kill(os.getpid(), signal.SIGKILL if kill_phase == "train" else signal.SIGTERM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        counter.batches += 1
        if manager.should_save(step + 1, model):
            manager.save(step + 1, model, opt, scheduler=sched, data=counter)
        if manager.preempted:
            manager.close()
            write(d, "preempted.pt", {"step": step + 1})
            return
    manager.close()
    if point:
        raise SystemExit(f"the kill at {point} never came")
    write(d, "result.pt", {"resumed": start, "state": full(model), "lr": sched.get_last_lr()})


def snapshot(d: Path) -> None:
    """FSDP2's background gather of a FULL save (AsyncFullCheckpoints) against the foreground one:
    the same keys and the same bytes, on rank 0, for the model and AdamW's state after 2 steps (the
    tiny Llama's embedding rows, 97, split unevenly over 2 ranks)."""
    from shardcore.capabilities import AsyncFullCheckpoints

    model, opt = sharded()
    rt = backend(model)
    assert isinstance(rt, AsyncFullCheckpoints)
    batches = make_batches("llama", STEPS, 8, 0)
    for step in range(2):
        loss_fn("llama", model, rt.local_batch(batches[step])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    gather = rt.snapshot_full_state_dict(model, opt)
    state, osd = rt.full_state_dict(model), rt.full_optimizer_state_dict(model, opt)
    with torch.no_grad():  # the copies are this rank's own: the model may change before the gather
        for p in model.parameters():
            p.add_(1.0)
    got_state, got_osd = gather()
    if rt.world().rank != 0:
        assert (got_state, got_osd) == ({}, None)
        return
    assert list(got_state) == list(state), (list(got_state), list(state))
    for k, v in state.items():
        assert got_state[k].dtype == v.dtype and torch.equal(got_state[k], v), k
    assert got_osd["param_groups"] == osd["param_groups"]
    assert got_osd["state"].keys() == osd["state"].keys()
    for name, per in osd["state"].items():
        assert per.keys() == got_osd["state"][name].keys(), name
        for k, v in per.items():
            assert torch.equal(got_osd["state"][name][k], v), (name, k)
    write(d, "snapshot.pt", {"tensors": len(state) + sum(len(p) for p in osd["state"].values())})


if __name__ == "__main__":
    if sys.argv[2] == "snapshot":
        run(snapshot, Path(sys.argv[1]))
    else:
        run(train, Path(sys.argv[1]), sys.argv[2], *sys.argv[3:])
