"""The benchmarks on an accelerator machine: overhead, memory per rank, and training throughput.

Any accelerator torch reports (``torch.accelerator``: CUDA, ROCm, XPU, HPU, MPS, a PrivateUse1
device), one rank per device, on its distributed backend (``shardcore.devices``). One prepared
script: it runs ``bench/overhead.py``'s FSDP2 comparison (shardcore vs hand-written ``fully_shard``,
as many ranks as devices up to 2), ``bench/memory.py``'s per-rank byte count (world sizes up to the
number of devices) and a throughput figure: a ~0.5B-parameter Llama sharded by ``shardcore.shard``
with bf16 mixed precision, tokens/s, peak memory (``torch.accelerator.max_memory_allocated``) and
model FLOP utilisation (MFU: 6 x params + attention FLOPs per token, over the devices' dense bf16
peak from the table below or ``--peak-tflops``), eager and with ``torch_compile`` (each decoder
layer compiled in place, inductor; the ratio compiled / eager tokens/s has the goal >= 1.10).
Without an accelerator it says so and exits 0.

    python bench/gpu.py --out results/gpu.json       # ~3-5 minutes on one H100/H200
"""

from __future__ import annotations

import argparse
import statistics
import sys
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

# dense bf16 peak per device, TFLOP/s (vendor data sheets; SXM/OAM parts), matched against the name
# torch reports; another device needs --peak-tflops for an MFU
PEAK_BF16_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,
    "MI300X": 1307.4,
    "MI250X": 383.0,
}
THROUGHPUT_CONFIG = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "mixed_precision": "bf16"}


def peak_tflops(name: str) -> float | None:
    for key, v in PEAK_BF16_TFLOPS.items():
        if key in name:
            return v
    return None


def throughput_rank(rank: int, world_size: int, size: str, steps: int, warmup: int, compiled: bool = False) -> dict:
    import torch.distributed as dist

    import shardcore

    device = rank_device(rank)
    torch.accelerator.reset_peak_memory_stats(device)
    config = {**THROUGHPUT_CONFIG, "torch_compile": True} if compiled else THROUGHPUT_CONFIG
    model = shardcore.shard(build_llama(size).to(device), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        data = batch(size, i, rank, device)
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        model(**data).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": times, "max_memory_allocated": torch.accelerator.max_memory_allocated(device)}


def run_throughput(
    size: str, steps: int, warmup: int, world_size: int, compiled: bool = False, peak: float | None = None
) -> dict:
    s = LLAMA_SIZES[size]
    n_params = sum(p.numel() for p in build_llama(size).parameters())
    per_rank = run_ranks(throughput_rank, world_size, (size, steps, warmup, compiled), timeout_s=900)
    step = statistics.median(per_rank[0]["step_s"])
    tokens = s["batch"] * s["seq"] * world_size
    # per token: 6N for the matmuls of forward+backward, plus attention scores/values 12 * L * d * seq
    flops_per_token = 6 * n_params + 12 * s["num_hidden_layers"] * s["hidden_size"] * s["seq"]
    achieved = flops_per_token * tokens / step
    return {
        "model": {"size": size, **s, "params": n_params},
        "config": {**THROUGHPUT_CONFIG, "torch_compile": True} if compiled else THROUGHPUT_CONFIG,
        "world_size": world_size,
        "step_s": summary(per_rank[0]["step_s"]),
        "tokens_per_s": tokens / step,
        "model_tflops_per_s": achieved / 1e12,
        "peak_bf16_tflops_per_device": peak,
        "mfu": achieved / (peak * 1e12 * world_size) if peak else None,
        "max_memory_allocated_per_rank": [r["max_memory_allocated"] for r in per_rank],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="result JSON (default bench/results/gpu.json)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", choices=sorted(LLAMA_SIZES), default="gpu", help="model for the throughput figure")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak in TFLOP/s, for the MFU (default: from the table of known devices)",
    )
    args = ap.parse_args(argv)
    kind = device_type()
    if kind == "cpu":
        print(
            "bench/gpu.py: no accelerator here (torch.accelerator.is_available() is False); nothing measured. "
            "Run bench/overhead.py and bench/memory.py for the CPU figures."
        )
        return 0
    import memory
    import overhead

    from shardcore.devices import describe

    ngpu = torch.accelerator.device_count()
    name = describe(torch.device(kind, 0))["name"]
    peak = args.peak_tflops or peak_tflops(name)
    print(f"bench/gpu.py: {ngpu} x {name} ({kind}), torch {torch.__version__}", flush=True)
    out: dict = {}
    # the overhead model sized for a GPU step to be compute-bound, and the CPU one for comparison
    out["overhead"] = [overhead.run_fsdp2(sz, args.steps, 5, world_size=min(2, ngpu)) for sz in ("full", "gpu")]
    for r in out["overhead"]:
        print(overhead.report(r), flush=True)
    out["memory"] = [memory.run(size, [1, 2, 4]) for size in ("full", "odd")]
    for r in out["memory"]:
        print(memory.report(r), flush=True)
    out["throughput"] = run_throughput(args.size, args.steps, 3, ngpu, peak=peak)
    t = out["throughput"]
    mfu = f"{t['mfu'] * 100:.1f}%" if t["mfu"] is not None else "n/a (unknown peak: pass --peak-tflops)"
    print(
        f"throughput: {t['model']['params'] / 1e6:.0f}M-param Llama, bf16, {ngpu} {kind} device(s): "
        f"{t['tokens_per_s']:,.0f} tokens/s, {t['model_tflops_per_s']:.1f} TFLOP/s, MFU {mfu}, peak memory "
        f"{max(t['max_memory_allocated_per_rank']) / 2**30:.2f} GiB per rank",
        flush=True,
    )
    # torch_compile: each decoder layer compiled in place (inductor); the first steps compile
    out["throughput_compiled"] = run_throughput(args.size, args.steps, 5, ngpu, compiled=True, peak=peak)
    c = out["throughput_compiled"]
    out["compiled_over_eager_tokens_per_s"] = c["tokens_per_s"] / t["tokens_per_s"]
    print(
        f"throughput with torch_compile: {c['tokens_per_s']:,.0f} tokens/s, compiled / eager "
        f"{out['compiled_over_eager_tokens_per_s']:.2f}x (goal >= 1.10)",
        flush=True,
    )
    path = write_result("gpu", out, args.out)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
