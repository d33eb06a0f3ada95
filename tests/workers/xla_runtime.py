"""``python xla_runtime.py MODE``: the runtime family on one (mode, device count), in one process.

First (so that nothing compiled the step before) 6 training steps, recording XLA's compile count
after each; then one training step per grad-ckpt setting, counting the forward calls of a unit's
MLP (xla_fsdp_grad_ckpt runs it again in backward). Rank 0 prints
``{"compiles": [...], "forwards": {"0": n, "1": n}}``.
"""

import sys

from xla_common import emitter, on_devices, sharded_llama, train


def scenario(mode: str, rank: int) -> None:
    model, backend = sharded_llama(mode)
    counts = []
    train(model, backend, 6, lambda i: counts.append(backend.compile_count()))
    del model, backend
    forwards = {}
    for gc in ("0", "1"):
        calls = []
        model, backend = sharded_llama(mode, gc == "1", lambda *a: calls.append(1))
        train(model, backend, 1)
        forwards[gc] = len(calls)
    # every device, not only the one that reports: its unit ran once, and again in backward with gc
    assert forwards == {"0": 1, "1": 2}, (rank, forwards)
    emitter(rank)({"compiles": counts, "forwards": forwards})


if __name__ == "__main__":
    mode = sys.argv[1]
    on_devices(mode, scenario, mode)
