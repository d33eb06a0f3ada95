"""``compile_ckpt.py OUT``: ``torch_compile`` under FSDP2 on this world, against the same schedule
trained eagerly and sharded: losses, checkpoint keys, and checkpoints moving between compiled and
eager runs (FULL and SHARDED, both ways); and a user's own ``torch.compile(model)`` after
``shard()``. Rank 0 writes what the test checks to OUT/compile.json."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import shardcore

from ckpt_common import STEPS, file_tensors, full, run, sharded, train, write

COMPILED = {"torch_compile": True, "torch_compile_backend": "aot_eager"}


def scenario(out: Path) -> None:
    eager, eager_opt = sharded(seed=0)
    eager_losses = train(eager, eager_opt, 0, STEPS)
    compiled, opt = sharded(seed=0, config=COMPILED)
    units = [m for m in compiled.modules() if getattr(m, "_shardcore_compiled", False)]
    hooked = all(type(m).__name__.startswith("FSDP") for m in units)  # fully_shard's class, hooks on it
    losses = train(compiled, opt, 0, STEPS)
    keys = sorted(compiled.state_dict())
    report = {"eager": eager_losses, "compiled": losses, "units": len(units), "hooked": hooked, "keys": keys}
    state = full(compiled)
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        shardcore.save(compiled, out / kind, opt, state_dict_type=kind)
        into_eager, into_eager_opt = sharded(seed=3)
        shardcore.load(into_eager, out / kind, into_eager_opt)
        back = out / f"{kind}-back"
        shardcore.save(into_eager, back, into_eager_opt, state_dict_type=kind)
        again, again_opt = sharded(seed=4, config=COMPILED)
        shardcore.load(again, back, again_opt)
        report[kind] = {
            "into_eager": _diff(state, full(into_eager)),
            "back_into_compiled": _diff(state, full(again)),
            "resumed": train(again, again_opt, 0, 1) == train(into_eager, into_eager_opt, 0, 1),
        }
    if dist.get_rank() == 0:
        report["saved_keys"] = sorted(file_tensors(out / "FULL_STATE_DICT"))
    # the user's way: shard eagerly, then torch.compile the whole sharded model
    user, user_opt = sharded(seed=0)
    user_compiled = torch.compile(user, backend="aot_eager")
    report["user_compiled"] = train(user_compiled, user_opt, 0, STEPS)
    write(out, "compile", report)


def _diff(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)  # rank 0 holds them


if __name__ == "__main__":
    run(scenario, Path(sys.argv[1]))
