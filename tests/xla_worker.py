"""XLA runs for tests/test_xla.py, each in its own process (PJRT settings are per process).

    python xla_worker.py compile  MODE STEPS           -> JSON: compile count after each step
    python xla_worker.py save     MODE DIR             -> trains 3 steps, shardcore.save FULL to DIR/ckpt,
                                                          full_state_dict to DIR/expected.safetensors
    python xla_worker.py load     MODE CKPT OUT        -> shardcore.load CKPT into a sharded model,
                                                          full_state_dict to OUT
    python xla_worker.py forwards MODE GC              -> JSON: forward calls of a unit's MLP in one step
MODE is "spmd" (xla_fsdp_v2) or "fsdp" (XlaFullyShardedDataParallel, one device).
"""
import json
import sys

import torch
import torch_xla  # noqa: F401  (initialise XLA before any CPU backward: see shared/xla-notes.md)
from safetensors.torch import save_file

import shardcore
from shardcore_conformance.models import build_model, loss_fn, make_batches


def sharded_llama(mode: str, grad_ckpt: bool = False, hook=None):
    cfg = {"xla": True, "xla_fsdp_v2": mode == "spmd", "xla_fsdp_grad_ckpt": grad_ckpt}
    model = build_model("llama", 0)
    if hook is not None:
        model.model.layers[0].mlp.register_forward_hook(hook)
    model = shardcore.shard(model, cfg)
    return model, shardcore.handle(model).backend


def train(model, backend, steps: int, after_step=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, batch in enumerate(make_batches("llama", steps, 8, 0)):
        loss = loss_fn("llama", model, backend.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        backend.step_end()
        float(loss)  # read the loss every step, as a training loop that logs it does
        if after_step:
            after_step(i)
    return opt


def main() -> None:
    cmd, mode = sys.argv[1], sys.argv[2]
    if cmd == "forwards":
        calls = []
        model, backend = sharded_llama(mode, sys.argv[3] == "1", lambda *a: calls.append(1))
        train(model, backend, 1)
        print(json.dumps({"forwards": len(calls)}))
        return
    model, backend = sharded_llama(mode)
    if cmd == "compile":
        counts = []
        train(model, backend, int(sys.argv[3]), lambda i: counts.append(backend.compile_count()))
        print(json.dumps({"compiles": counts}))
    elif cmd == "save":
        out = sys.argv[3]
        train(model, backend, 3)
        shardcore.save(model, f"{out}/ckpt")
        save_file({k: v.contiguous() for k, v in backend.full_state_dict(model).items()}, f"{out}/expected.safetensors")
    elif cmd == "load":
        shardcore.load(model, sys.argv[3])
        save_file({k: v.contiguous() for k, v in backend.full_state_dict(model).items()}, sys.argv[4])
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main()
