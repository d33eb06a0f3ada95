"""Gradient accumulation with and without ``shardcore.no_sync``: collectives and time per optimizer step.

Each optimizer step runs ``--accum`` micro-batches. "every" reduces gradients after every micro-batch
(a plain loop); "no_sync" wraps all but the last micro-batch in ``shardcore.no_sync(model)``, so the
gradients are reduced once per step. Both variants live in the same processes, start from the same
weights, see the same batches and train in alternating steps (ABBA), so machine noise hits both alike.

* FSDP2 (always): 2 gloo ranks (NCCL on CUDA). Counted: ``torch.distributed.reduce_scatter_tensor``
  and ``all_reduce`` calls per optimizer step (FSDP2 reduce-scatters each unit's gradients once per
  backward). ``no_sync`` is FSDP2's ``set_requires_gradient_sync(False)``: the unsharded gradients
  stay on the rank until the last micro-batch.
* XLA FSDP (``--xla``): 2 PJRT CPU devices (threads of one process). Counted: the reduce-scatters
  each ``XlaFullyShardedDataParallel`` unit traces per optimizer step (its ``reduce_scatter_op``,
  called once per sharded parameter, or once per unit with ``flatten_parameters``); ``no_sync`` is
  XlaFullyShardedDataParallel's own ``no_sync()``.

Printed per backend: calls per optimizer step (goal: one backward's reductions with no_sync, accum
times that without), the median CPU-time ratio no_sync/every (CPU seconds of all ranks together, less sensitive
to other jobs than wall time), the wall-time ratio, and the largest parameter difference between
the two variants at the end (the same training, up to summation order).

    python bench/accumulation.py                    # writes bench/results/accumulation.json
    python bench/accumulation.py --xla              # and XLA FSDP, if torch_xla is installed
    python bench/accumulation.py --size tiny --steps 2 --warmup 1      # the smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    LLAMA_SIZES,
    batch,
    build_llama,
    device_type,
    rank_device,
    run_ranks,
    summary,
    synchronize,
    write_result,
)

CONFIG = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True}
VARIANTS = ("no_sync", "every")


def _optimizer_step(model, opt, micro: list[dict], no_sync: bool, end) -> None:
    import shardcore

    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        with shardcore.no_sync(model) if no_sync and not last else contextlib.nullcontext():
            (model(**mb).loss / len(micro)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    end()


def _measure(models: dict, opts: dict, data, steps: int, warmup: int, count, end, sync) -> dict:
    """ABBA over the variants; per timed step: wall s, this process's CPU s, collective calls."""
    out = {k: {"wall": [], "cpu": [], "calls": []} for k in models}
    for i in range(warmup + steps):
        order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        micro = data(i)
        for k in order:
            sync()
            c0, t0, n0 = time.process_time(), time.perf_counter(), count()
            _optimizer_step(models[k], opts[k], micro, k == "no_sync", end)
            sync()
            if i >= warmup:
                out[k]["wall"].append(time.perf_counter() - t0)
                out[k]["cpu"].append(time.process_time() - c0)
                out[k]["calls"].append(count() - n0)
    return out


# ------------------------------------------------------------------------------------------ FSDP2


def fsdp2_rank(rank: int, world_size: int, size: str, accum: int, steps: int, warmup: int, threads: int) -> dict:
    import torch.distributed as dist

    import shardcore

    torch.set_num_threads(threads)
    device = rank_device(rank)
    models = {k: shardcore.shard(build_llama(size).to(device), CONFIG) for k in VARIANTS}
    sc = shardcore.handle(models["no_sync"])
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    units = sum(1 for m in models["every"].modules() if type(m).__name__.startswith("FSDP"))

    calls = [0]

    def counting(fn):
        def wrapper(*a, **kw):
            calls[0] += 1
            return fn(*a, **kw)

        return wrapper

    # FSDP2 looks these up on torch.distributed at call time
    dist.reduce_scatter_tensor = counting(dist.reduce_scatter_tensor)
    if hasattr(dist, "reduce_scatter_single"):  # newer torch: FSDP2 calls it, the old name delegates
        dist.reduce_scatter_single = counting(dist.reduce_scatter_single)
    dist.all_reduce = counting(dist.all_reduce)

    def sync():
        synchronize(device)
        dist.barrier()

    def data(i):
        return [batch(size, i * accum + j, rank, device) for j in range(accum)]

    res = _measure(models, opts, data, steps, warmup, lambda: calls[0], lambda: None, sync)
    diff = max(
        float((a.full_tensor() - b.full_tensor()).abs().max())
        for a, b in zip(models["no_sync"].parameters(), models["every"].parameters())
    )
    res["units"], res["max_param_diff"], res["world_size"] = units, diff, sc.world_size
    res["reductions_per_backward"] = units  # FSDP2: one reduce-scatter per unit (its parameters flattened)
    return res


def run_fsdp2(size: str, accum: int, steps: int, warmup: int, world_size: int = 2) -> dict:
    threads = max(1, (os.cpu_count() or 2) // world_size) if device_type() == "cpu" else 4
    per_rank = run_ranks(fsdp2_rank, world_size, (size, accum, steps, warmup, threads), timeout_s=1800)
    return _report(
        "fsdp2",
        per_rank,
        size,
        accum,
        steps,
        warmup,
        "reduce_scatter_tensor + all_reduce calls",
        device_type(),
    )


def _report(
    backend: str, per_rank: list[dict], size: str, accum: int, steps: int, warmup: int, what: str, device: str
) -> dict:
    r0 = per_rank[0]
    # CPU seconds of all ranks together (device threads: one process, so one figure)
    cpu = {k: [sum(r[k]["cpu"][i] for r in per_rank) for i in range(steps)] for k in VARIANTS}
    calls = {k: sorted(set(r0[k]["calls"])) for k in VARIANTS}
    return {
        "backend": backend,
        "world_size": r0["world_size"],
        "device": device,
        "model": {"size": size, **LLAMA_SIZES[size]},
        "accum": accum,
        "steps": steps,
        "warmup": warmup,
        "units": r0["units"],
        "counted": what,
        "calls_per_optimizer_step": {k: calls[k][0] if len(calls[k]) == 1 else calls[k] for k in VARIANTS},
        "reductions_per_backward": r0["reductions_per_backward"],
        "goal_calls": {"no_sync": r0["reductions_per_backward"], "every": r0["reductions_per_backward"] * accum},
        "cpu_s": {k: summary(cpu[k]) for k in VARIANTS},
        "cpu_ratio_no_sync_over_every": statistics.median(cpu["no_sync"]) / statistics.median(cpu["every"]),
        "wall_s": {k: summary(r0[k]["wall"]) for k in VARIANTS},
        "wall_ratio_no_sync_over_every": statistics.median(r0["no_sync"]["wall"])
        / statistics.median(r0["every"]["wall"]),
        "max_param_diff": max(r["max_param_diff"] for r in per_rank),
    }


# ------------------------------------------------------------------------------------------- XLA


def run_xla(size: str, accum: int, steps: int, warmup: int, devices: int = 2) -> dict:
    """In a child process: the PJRT settings are per process and must precede torch_xla."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    env.pop("USE_TORCH_XLA", None)
    with tempfile.TemporaryDirectory(prefix="shardcore-bench-") as tmp:
        cmd = [
            sys.executable,
            __file__,
            "--_xla-child",
            tmp,
            "--size",
            size,
            "--accum",
            str(accum),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            return {"backend": "xla", "error": out.stderr[-4000:]}
        per_rank = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    # one process: the CPU time is the process's, counted once (on device 0)
    for r in per_rank[1:]:
        for k in VARIANTS:
            r[k]["cpu"] = [0.0] * len(r[k]["cpu"])
    return _report(
        "xla (XlaFullyShardedDataParallel)",
        per_rank,
        size,
        accum,
        steps,
        warmup,
        "reduce-scatters traced by the units",
        f"PJRT CPU x{devices}",
    )


def _xla_child(out_dir: str, size: str, accum: int, steps: int, warmup: int) -> None:
    import functools

    import shardcore

    # built here, not in the device threads (Transformers' lazy imports are not thread-safe)
    init = build_llama(size).state_dict()
    shardcore.get_backend("xla").run_on_devices(
        functools.partial(_xla_device, out_dir=out_dir, size=size, accum=accum, steps=steps, warmup=warmup, init=init)
    )


# Transformers' lazy module loading is not thread-safe: device threads build their models one at a time
_BUILD_LOCK = threading.Lock()


class _Counting:
    """A unit's reduce-scatter op, counted (it is called once per gradient reduction it traces)."""

    def __init__(self, op, calls: list[int]):
        self._op, self._calls = op, calls

    def __call__(self, *a, **kw):
        self._calls[0] += 1
        return self._op(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._op, name)


def _xla_device(index: int, out_dir: str, size: str, accum: int, steps: int, warmup: int, init: dict) -> None:
    import shardcore

    models = {}
    for k in VARIANTS:
        with _BUILD_LOCK:
            m = build_llama(size)
        m.load_state_dict(init)
        models[k] = shardcore.shard(m, {**CONFIG, "xla": True})
    sc = shardcore.handle(models["no_sync"])
    calls = [0]
    units = per_backward = 0
    for m in models.values():
        for u in m.modules():
            if hasattr(u, "reduce_scatter_op"):
                u.reduce_scatter_op = _Counting(u.reduce_scatter_op, calls)
                units += 1
                # one reduce-scatter per sharded parameter (one flat one with flatten_parameters)
                per_backward += len(u.sharded_params)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}

    def data(i):
        return [sc.local_batch(batch(size, i * accum + j, 0, "cpu")) for j in range(accum)]

    res = _measure(models, opts, data, steps, warmup, lambda: calls[0], sc.step_end, lambda: None)
    full = {k: sc.backend.full_state_dict(m) for k, m in models.items()}
    res["max_param_diff"] = max(float((full["no_sync"][n] - full["every"][n]).abs().max()) for n in full["every"])
    res["units"], res["world_size"] = units // len(VARIANTS), sc.world_size
    res["reductions_per_backward"] = per_backward // len(VARIANTS)
    Path(out_dir, f"rank{sc.rank}.json").write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="full", choices=sorted(LLAMA_SIZES))
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--xla", action="store_true", help="also XLA FSDP on 2 PJRT CPU devices")
    ap.add_argument("--out", help="JSON results (default bench/results/accumulation.json)")
    ap.add_argument("--_xla-child", dest="xla_child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.xla_child:
        _xla_child(args.xla_child, args.size, args.accum, args.steps, args.warmup)
        return
    results = [run_fsdp2(args.size, args.accum, args.steps, args.warmup)]
    if args.xla:
        results.append(run_xla(args.size, args.accum, args.steps, args.warmup))
    failed = False
    for r in results:
        if "error" in r:
            print(f"{r['backend']}: FAILED\n{r['error']}")
            failed = True
            continue
        calls, goal = r["calls_per_optimizer_step"], r["goal_calls"]
        print(
            f"{r['backend']} on {r['world_size']} ranks ({r['device']}), {r['units']} units, "
            f"{r['reductions_per_backward']} gradient reductions per backward, accum {r['accum']}, model {r['model']['size']}"
        )
        print(
            f"  {r['counted']} per optimizer step: no_sync {calls['no_sync']} (goal {goal['no_sync']}), "
            f"every micro-batch {calls['every']} (goal {goal['every']})"
        )
        print(
            f"  cpu-time ratio no_sync/every {r['cpu_ratio_no_sync_over_every']:.3f}  "
            f"wall-time ratio {r['wall_ratio_no_sync_over_every']:.3f}  "
            f"max parameter difference {r['max_param_diff']:.2e}"
        )
        failed |= calls != goal
    path = write_result("accumulation", {"results": results}, args.out)
    print(f"wrote {path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
