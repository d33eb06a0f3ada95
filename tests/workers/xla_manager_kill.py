"""``python xla_manager_kill.py MODE DIR KIND SAVES [POINT]``: workers/ckpt_manager.py's job on XLA
(MODE "fsdp": XLA FSDP, one thread per CPU device; "spmd": one controller). The conformance MLP is
trained STEPS steps under a CheckpointManager in ``DIR/ckpt`` (KIND checkpoints every 2 steps, the
last 2 kept; SAVES "sync" or "async"), resumed first from the newest complete step. Rank 0 writes
``DIR/result.pt``: the step it resumed from and the final state.

POINT ``phase:step:all`` SIGKILLs the process at ``phase`` of step ``step`` (ckpt_manager.PHASES).
Every rank is a thread of this one process, so the kill takes the whole job down, at the first rank
that gets there. ``sigterm:step:all`` sends a SIGTERM in step ``step`` instead: every rank saves the
next step and stops, rank 0 writing ``DIR/preempted.pt`` with the step saved.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch_xla  # noqa: F401  (initialise XLA before any CPU backward: see shared/xla-notes.md)
from ckpt_manager import Counter, arm

import shardcore
from shardcore_conformance.models import build_model, loss_fn, make_batches

from xla_common import on_devices

STEPS, EVERY, MODEL = 6, 2, "mlp"


def job(mode: str, d: Path, kind: str, saves: str, kill: tuple[str, int], saving: dict, rank: int) -> None:
    cfg = {"xla": True, "xla_fsdp_v2": mode == "spmd", "state_dict_type": kind}
    model = shardcore.shard(build_model(MODEL, 0), cfg)
    backend = shardcore.handle(model).backend
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter()
    manager = shardcore.CheckpointManager(
        d / "ckpt", keep_last=2, every=EVERY, async_save=saves == "async", save_on_signal=signal.SIGTERM
    )
    start = manager.restore(model, opt, scheduler=sched, data=counter) or 0
    assert counter.batches == start, (counter.batches, start)
    print(f"rank {rank} restored step {start}", flush=True)
    batches = make_batches(MODEL, STEPS, 8, 0)
    for step in range(start, STEPS):
        loss = loss_fn(MODEL, model, backend.local_batch(batches[step]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        backend.step_end()
        if kill == ("train", step):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if kill == ("sigterm", step):
            if rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            # the kernel hands the signal to any thread of the process; it has arrived in this
            # step once shardcore has seen it (its wakeup pipe, while the main thread waits)
            while not manager.signal_received:
                time.sleep(0.01)
        counter.batches += 1
        if manager.should_save(step + 1, model):
            saving["step"] = step + 1
            manager.save(step + 1, model, opt, scheduler=sched, data=counter)
        if manager.preempted:
            manager.close()
            if rank == 0:
                torch.save({"step": step + 1}, d / "preempted.pt")
            return
    manager.close()
    if kill[0]:
        raise SystemExit(f"the kill at {kill} never came")
    state = {k: v.clone() for k, v in backend.full_state_dict(model).items()}
    if rank == 0:
        torch.save({"resumed": start, "state": state, "lr": sched.get_last_lr()}, d / "result.pt")


if __name__ == "__main__":
    mode, d, kind, saves, *point = sys.argv[1:]
    saving: dict = {}
    # armed once, before the device threads start: they share the patched checkpoint code
    kill = arm(point[0], saving) if point else ("", -1)
    shardcore.CheckpointManager.listen(signal.SIGTERM)  # the ranks' managers are made in device threads
    on_devices(mode, job, mode, Path(d), kind, saves, kill, saving)
