"""``python xla_threads.py``: what device threads of one process (XLA FSDP on CPU_NUM_DEVICES CPU
devices) must not race on, in one process. Rank 0 prints one JSON object:

* ``fallbacks``: the CPU-fallback ops torch_xla has counted right after shard(), before any other
  code ran (so first);
* ``losses``: 3 training steps in which every device drops a cycle holding a lazy tensor, and the
  cycle collector runs after device 0 dropped its cycle, before device 1 does;
* ``refusals``: shard() with what validate_model refuses, then a good config, then an odd batch:
  every device's errors (``ranks``) and the devices apply ran on (``applied``).
"""

import gc

import torch
import torch_xla.debug.metrics as met

import shardcore
from shardcore_conformance.models import build_model, loss_fn, make_batches
from shardcore_xla import XlaFsdpBackend

from xla_common import emitter, on_devices, sharded_llama


class RecordsApply(XlaFsdpBackend):
    """XLA FSDP, recording the device of every apply call."""

    name = "xla-records-apply"

    def __init__(self):
        super().__init__()
        self.applied = []

    def apply(self, model, plan, config):
        import torch_xla.runtime as xr

        self.applied.append(xr.global_ordinal())
        return super().apply(model, plan, config)


_RECORDER = RecordsApply()  # one instance for every device thread, as get_backend gives


def garbage(model, backend, rank: int) -> list[float]:
    threads = backend._threads
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for batch in make_batches("llama", 3, 8, 0):
        loss = loss_fn("llama", model, backend.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        # what automatic collection does now and then, made certain: it runs, on any thread,
        # between two devices' drops of an autograd graph or a hook closure
        for turn in range(threads.size):
            if rank == turn:
                junk = [loss * 2]
                junk.append(junk)
                del junk
                if turn == 0:
                    gc.collect()
            threads.wait()
        backend.step_end()
        losses.append(float(loss))
    return losses


def refusals(rank: int) -> dict:
    x = {"xla": True}
    attempts = {
        "pin_layout": ({**x, "xla_fsdp_settings": {"pin_layout_in_collective_ops": True}}, False),
        "rank0_meta": ({**x, "cpu_ram_efficient_loading": True}, rank == 0),
        "device1_meta": (x, rank == 1),
    }
    seen = {}
    for name, (cfg, meta) in attempts.items():
        model = build_model("mlp", 0)
        try:
            shardcore.shard(model.to("meta") if meta else model, cfg, backend=_RECORDER)
            seen[name] = None
        except shardcore.ShardcoreError as e:
            seen[name] = {"type": type(e).__name__, "key": getattr(e, "key", None), "message": str(e)}
    shardcore.shard(build_model("mlp", 0), x, backend=_RECORDER)
    try:
        _RECORDER.local_batch({"x": torch.zeros(3, 13)})
        batch = None
    except shardcore.ShardcoreError as e:
        batch = type(e).__name__
    everyone = _RECORDER._threads.exchange(rank, {"seen": seen, "batch": batch})  # after every apply
    return {"ranks": everyone, "applied": sorted(_RECORDER.applied)}


def scenario(rank: int) -> None:
    model, backend = sharded_llama("fsdp")
    fallbacks = sorted(met.executed_fallback_ops())
    losses = garbage(model, backend, rank)
    assert all(l == l for l in losses) and losses[0] != losses[-1], (rank, losses)  # every device trained
    emitter(rank)({"fallbacks": fallbacks, "losses": losses, "refusals": refusals(rank)})


if __name__ == "__main__":
    on_devices("fsdp", scenario)
