"""``python xla_manager.py MODE OUT``: a CheckpointManager on the XLA backend (MODE "fsdp" or
"spmd"). For FULL with synchronous saves and SHARDED with async ones: train 3 steps saving every 2,
build the model anew, restore, train to step 6; rank 0 prints the step restored and, per format,
the largest difference to 6 uninterrupted steps, as JSON."""

import sys

import torch

import shardcore
from shardcore_conformance.models import loss_fn, make_batches

from xla_common import emitter, on_devices, sharded_llama

STEPS = 6


def _steps(model, backend, opt, sched, first, last, manager=None):
    for step, batch in list(enumerate(make_batches("llama", STEPS, 8, 0)))[first:last]:
        loss = loss_fn("llama", model, backend.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        backend.step_end()
        if manager is not None and manager.should_save(step + 1):
            manager.save(step + 1, model, opt, scheduler=sched)


def _fresh(mode, kind):
    model, backend = sharded_llama(mode, state_dict_type=kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, backend, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def scenario(mode: str, out: str, rank: int) -> None:
    model, backend, opt, sched = _fresh(mode, "FULL_STATE_DICT")
    _steps(model, backend, opt, sched, 0, STEPS)
    want = {k: v.clone() for k, v in backend.full_state_dict(model).items()}
    result = {}
    for kind, asynchronous in (("FULL_STATE_DICT", False), ("SHARDED_STATE_DICT", True)):
        d = f"{out}/{kind}"
        manager = shardcore.CheckpointManager(d, keep_last=2, every=2, state_dict_type=kind, async_save=asynchronous)
        model, backend, opt, sched = _fresh(mode, kind)
        _steps(model, backend, opt, sched, 0, 3, manager)  # saves step 2; step 3 is lost
        manager.close()
        model, backend, opt, sched = _fresh(mode, kind)
        manager = shardcore.CheckpointManager(d, keep_last=2, every=2, state_dict_type=kind, async_save=asynchronous)
        start = manager.restore(model, opt, scheduler=sched)
        _steps(model, backend, opt, sched, start, STEPS, manager)
        manager.close()
        got = backend.full_state_dict(model)
        diff = max(float((got[k] - v).abs().max()) for k, v in want.items()) if rank == 0 else 0.0
        result[kind] = {"restored": start, "max_diff": diff, "steps": [s for s, _ in manager.checkpoints()]}
    emitter(rank)(result)


if __name__ == "__main__":
    mode, out = sys.argv[1:3]
    on_devices(mode, scenario, mode, out)
