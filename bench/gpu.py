"""The benchmarks on a CUDA machine: overhead, memory per rank, and training throughput.

One prepared script: it runs ``bench/overhead.py``'s FSDP2 comparison (shardcore vs hand-written
``fully_shard``, NCCL, as many ranks as GPUs up to 2), ``bench/memory.py``'s per-rank byte count
(world sizes up to the number of GPUs) and a throughput figure: a ~0.5B-parameter Llama sharded by
``shardcore.shard`` with bf16 mixed precision, tokens/s and model FLOP utilisation (MFU: 6 x params +
attention FLOPs per token, over the GPUs' dense bf16 peak), eager and with ``torch_compile`` (each
decoder layer compiled in place, inductor; the ratio compiled / eager tokens/s has the goal >= 1.10).
Without CUDA it says so and exits 0.

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
from _common import LLAMA_SIZES, batch, build_llama, run_ranks, summary, write_result  # noqa: E402

# dense bf16 peak per GPU, TFLOP/s (vendor data sheets; SXM parts)
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,
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

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    config = {**THROUGHPUT_CONFIG, "torch_compile": True} if compiled else THROUGHPUT_CONFIG
    model = shardcore.shard(build_llama(size).to(device), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        data = batch(size, i, rank, device)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        model(**data).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": times, "max_memory_allocated": torch.cuda.max_memory_allocated(device)}


def run_throughput(size: str, steps: int, warmup: int, world_size: int, compiled: bool = False) -> dict:
    s = LLAMA_SIZES[size]
    n_params = sum(p.numel() for p in build_llama(size).parameters())
    per_rank = run_ranks(throughput_rank, world_size, (size, steps, warmup, compiled), timeout_s=900)
    step = statistics.median(per_rank[0]["step_s"])
    tokens = s["batch"] * s["seq"] * world_size
    # per token: 6N for the matmuls of forward+backward, plus attention scores/values 12 * L * d * seq
    flops_per_token = 6 * n_params + 12 * s["num_hidden_layers"] * s["hidden_size"] * s["seq"]
    achieved = flops_per_token * tokens / step
    peak = peak_tflops(torch.cuda.get_device_name(0))
    return {
        "model": {"size": size, **s, "params": n_params},
        "config": {**THROUGHPUT_CONFIG, "torch_compile": True} if compiled else THROUGHPUT_CONFIG,
        "world_size": world_size,
        "step_s": summary(per_rank[0]["step_s"]),
        "tokens_per_s": tokens / step,
        "model_tflops_per_s": achieved / 1e12,
        "peak_bf16_tflops_per_gpu": peak,
        "mfu": achieved / (peak * 1e12 * world_size) if peak else None,
        "max_memory_allocated_per_rank": [r["max_memory_allocated"] for r in per_rank],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="result JSON (default bench/results/gpu.json)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", choices=sorted(LLAMA_SIZES), default="gpu", help="model for the throughput figure")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False); nothing measured. "
            "Run bench/overhead.py and bench/memory.py for the CPU figures."
        )
        return 0
    import memory
    import overhead

    ngpu = torch.cuda.device_count()
    print(f"bench/gpu.py: {ngpu} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    out: dict = {}
    # the overhead model sized for a GPU step to be compute-bound, and the CPU one for comparison
    out["overhead"] = [overhead.run_fsdp2(sz, args.steps, 5, world_size=min(2, ngpu)) for sz in ("full", "gpu")]
    for r in out["overhead"]:
        print(overhead.report(r), flush=True)
    out["memory"] = [memory.run(size, [1, 2, 4]) for size in ("full", "odd")]
    for r in out["memory"]:
        print(memory.report(r), flush=True)
    out["throughput"] = run_throughput(args.size, args.steps, 3, ngpu)
    t = out["throughput"]
    mfu = f"{t['mfu'] * 100:.1f}%" if t["mfu"] is not None else "n/a (unknown GPU peak)"
    print(
        f"throughput: {t['model']['params'] / 1e6:.0f}M-param Llama, bf16, {ngpu} GPU(s): "
        f"{t['tokens_per_s']:,.0f} tokens/s, {t['model_tflops_per_s']:.1f} TFLOP/s, MFU {mfu}",
        flush=True,
    )
    # torch_compile: each decoder layer compiled in place (inductor); the first steps compile
    out["throughput_compiled"] = run_throughput(args.size, args.steps, 5, ngpu, compiled=True)
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
