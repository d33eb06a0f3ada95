"""Communication per optimizer step against the ZeRO-3 minimum, and compiled vs eager step time.

Bytes: each rank's collectives during the step's forward and backward, counted by the conformance
suite's recorder (``shardcore_conformance.comm.CommRecorder``: full-size tensors, so an all-gather
counts the gathered parameters and a reduce-scatter the unreduced gradients), divided by the least
that sharded data parallelism of that config must move:

    every parameter gathered once for forward, in the all-gather dtype
  + every parameter but the root's gathered again for backward (``reshard_after_forward``: true)
  + every gradient reduce-scattered once, in the reduce dtype
  + HSDP: every rank's gradient shard all-reduced across the replicas once

With tensor parallelism (``tp_size``), sharding moves each rank's tp slices, and the minimum adds
Megatron's tensor-parallel traffic per forward and backward: each row split's output summed once,
a gathered output gathered once, and in backward the input gradient of each block's column splits
summed once (q, k and v read one input). Collectives of both kinds count: the recorder also sees
DTensor's functional collectives.

Configs: reshard on and off, bf16 parameters (``mixed_precision``), on 2 gloo ranks, HSDP 2x2 on 4,
and TP: tp 2 on 2 ranks, dp_shard 2 x tp 2 and 2 replicas x tp 2 on 4. Goal: 1.00 +- 0.01 (the
Llama's dim-0 sizes divide the shard counts; ``--size odd`` shows what the padding of the last
shard costs, and refuses TP: its 5 heads do not split in 2).

Time: the same FSDP2 training with ``torch_compile`` (inductor, units compiled in place) and
without, in the same processes, alternating steps (ABBA), on a 4-layer, hidden-256 Llama; printed
is the median ratio compiled/eager of per-step CPU time (all ranks' threads) and of wall time, after
the compiled model's first steps (compilation). Inductor's CPU code is not expected to beat eager at
this size; the ratio is reported, not tuned.

    python bench/comm.py                 # writes bench/results/comm.json
    python bench/comm.py --size tiny --steps 2 --time-steps 2     # the smoke test
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import LLAMA_SIZES, batch, build_llama, run_ranks, write_result  # noqa: E402

LLAMA_SIZES.setdefault(
    "compile",
    dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        seq=64,
        batch=4,
    ),
)
CONFIGS = {
    "reshard": (2, {"reshard_after_forward": True}),
    "no_reshard": (2, {"reshard_after_forward": False}),
    "bf16_params": (2, {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}),
    "hsdp_2x2": (4, {"dp_replicate_size": 2, "dp_shard_size": 2}),
    # tensor parallelism under FSDP (the model's own plan): pure TP, dp_shard 2 x tp 2, 2 replicas x tp 2
    "tp2": (2, {"tp_size": 2}),
    "dp2_tp2": (4, {"tp_size": 2}),
    "hsdp2_tp2": (4, {"tp_size": 2, "dp_replicate_size": 2}),
}


def minimum(model: torch.nn.Module, config: dict, world_size: int, tokens: int = 0) -> int:
    """The ZeRO-3 minimum of bytes per rank per optimizer step (module docstring), unpadded; with
    tensor parallelism on this rank's tp slices, plus TP's minimum for ``tokens`` rows x positions."""
    import shardcore
    from shardcore.plan import build_plan
    from shardcore.validate import data_parallel_shape
    from shardcore_conformance.comm import itemsize

    cfg = shardcore.parse_config(config)
    replicas, shards = data_parallel_shape(cfg, world_size)
    mp = cfg.mixed_precision
    gather = (itemsize(mp.param_dtype) if mp else None) or 4
    reduce = (itemsize(mp.reduce_dtype or mp.param_dtype) if mp else None) or 4
    params = dict(model.named_parameters())
    plan = build_plan(model, cfg)
    total = _tp_minimum(model, plan.tp, tokens, gather) if plan.tp is not None else 0

    def local(name: str) -> int:
        return math.prod(plan.tp.local_shape(name, params[name].shape)) if plan.tp else params[name].numel()

    for unit in plan.all_units():
        n = sum(local(name) for name in unit.param_names)
        again = cfg.reshard_after_forward and not unit.is_root
        if shards > 1:  # a shard group of one rank holds whole parameters: nothing to gather or scatter
            total += n * gather * (2 if again else 1) + n * reduce
        if replicas > 1:
            total += n * reduce // shards
    return total


def _tp_minimum(model: torch.nn.Module, tp, tokens: int, size: int) -> int:
    """Megatron's tensor-parallel traffic for one forward and backward of ``tokens`` rows x
    positions, in ``size``-byte activations: each row split's output summed once (an all-reduce), a
    gathered output gathered once; in backward, the input gradient of the column splits summed once
    per block (the layers of one parent read one input: q, k, v), a split input's gathered once."""
    from shardcore_conformance.comm import _GATHERS_INPUT_GRAD, _GATHERS_OUTPUT, _SUMS_INPUT_GRAD, _SUMS_OUTPUT

    total, blocks = 0, set()
    for name, style in tp.styles:
        m = model.get_submodule(name)
        out = m.out_features if isinstance(m, torch.nn.Linear) else m.embedding_dim
        if style in _GATHERS_OUTPUT or style in _SUMS_OUTPUT:
            total += tokens * out * size
        parent = name.rpartition(".")[0]
        if style in _SUMS_INPUT_GRAD and parent not in blocks:
            blocks.add(parent)
            total += tokens * m.in_features * size
        elif style in _GATHERS_INPUT_GRAD:
            total += tokens * m.in_features * size
    return total


def _bytes_rank(rank: int, world_size: int, size: str, configs: list[dict], steps: int) -> list[dict]:
    """Every config of this world size in turn, in the same processes (one launch per world size)."""
    import shardcore
    from shardcore_conformance.comm import CommRecorder

    torch.set_num_threads(1)
    out = []
    for config in configs:
        model = build_llama(size)
        tp = config.get("tp_size", 1)
        # local_batch gives each data-parallel group (tp ranks) its rows of the global batch
        tokens = LLAMA_SIZES[size]["batch"] * tp * LLAMA_SIZES[size]["seq"]
        floor = minimum(model, config, world_size, tokens)
        model = shardcore.shard(model, config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        h = shardcore.handle(model)
        recorder = CommRecorder(functional=tp > 1).install()
        for step in range(steps):
            recorder.begin_step()
            with recorder.recording():
                model(**h.local_batch(_global(size, step, world_size))).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        recorder.uninstall()
        out.append({"minimum": floor, "steps": recorder.steps})
    torch.distributed.destroy_process_group()
    return out


def _takes(size: str, config: dict) -> bool:
    """Whether this size of Llama can be sharded so (tensor parallelism needs heads it divides)."""
    import shardcore
    from shardcore.plan import build_plan

    try:
        build_plan(build_llama(size), shardcore.parse_config(config))
    except shardcore.ShardConfigError as e:
        print(f"  (left out: {config}: {e})")
        return False
    return True


def _global(size: str, step: int, world_size: int) -> dict:
    """One global batch (every rank's rows) that ``local_batch`` slices, as a training script does."""
    rows = [batch(size, step, r) for r in range(world_size)]
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def _time_rank(rank: int, world_size: int, size: str, steps: int, warmup: int) -> dict:
    import shardcore

    torch.set_num_threads(1)
    models, opts = {}, {}
    for name, cfg in (("eager", {}), ("compiled", {"torch_compile": True})):
        models[name] = shardcore.shard(build_llama(size), cfg)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
    h = shardcore.handle(models["eager"])
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
    for step in range(warmup + steps):
        order = ("eager", "compiled") if step % 2 == 0 else ("compiled", "eager")  # ABBA
        for name in order:
            b = h.local_batch(_global(size, step, world_size))
            torch.distributed.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            models[name](**b).loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            torch.distributed.barrier()
            if step >= warmup:
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    torch.distributed.destroy_process_group()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="full", choices=sorted(LLAMA_SIZES))
    p.add_argument("--steps", type=int, default=3, help="optimizer steps counted per config")
    p.add_argument("--time-size", default="compile", choices=sorted(LLAMA_SIZES))
    p.add_argument("--time-steps", type=int, default=20, help="timed steps per variant (0: no timing)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compilation)")
    p.add_argument("--out", help="result JSON (default bench/results/comm.json)")
    args = p.parse_args(argv)

    rows = {}
    print(f"bytes per rank per optimizer step / ZeRO-3 minimum (Llama size {args.size}):")
    configs = {n: c for n, c in CONFIGS.items() if _takes(args.size, c[1])}
    measured = {}
    for world in sorted({w for w, _ in configs.values()}):
        names = [n for n, (w, _) in configs.items() if w == world]
        ranks = run_ranks(_bytes_rank, world, (args.size, [configs[n][1] for n in names], args.steps))
        measured.update({n: [r[i] for r in ranks] for i, n in enumerate(names)})
    for name, (world, config) in configs.items():
        ranks = measured[name]
        moved = [sum(k["bytes"] for k in s.values()) for r in ranks for s in r["steps"]]
        floor = ranks[0]["minimum"]
        ratios = [m / floor for m in moved]
        rows[name] = {
            "world_size": world,
            "config": config,
            "minimum_bytes": floor,
            "bytes_per_step": sorted(set(moved)),
            "ratio": max(ratios, key=lambda r: abs(r - 1)),
            "calls_per_step": {k: v["count"] for k, v in ranks[0]["steps"][-1].items()},
        }
        print(
            f"  {name:<12} {world} ranks: {max(moved):>12,} B / {floor:>12,} B = {rows[name]['ratio']:.4f}  "
            f"calls {rows[name]['calls_per_step']}"
        )
    ok = all(abs(r["ratio"] - 1) <= 0.01 for r in rows.values())
    print(f"goal 1.00 +- 0.01: {'met' if ok else 'NOT met'}")

    timing = None
    if args.time_steps > 0:
        times = run_ranks(_time_rank, 2, (args.time_size, args.time_steps, args.warmup))
        n = args.time_steps
        cpu = {v: [sum(t[v][i][0] for t in times) for i in range(n)] for v in ("eager", "compiled")}
        wall = {v: [max(t[v][i][1] for t in times) for i in range(n)] for v in ("eager", "compiled")}
        timing = {
            "size": args.time_size,
            "steps": n,
            "cpu_ratio_median": statistics.median(c / e for c, e in zip(cpu["compiled"], cpu["eager"])),
            "wall_ratio_median": statistics.median(c / e for c, e in zip(wall["compiled"], wall["eager"])),
            "eager_wall_ms_median": statistics.median(wall["eager"]) * 1e3,
        }
        print(
            f"compiled / eager step time (Llama size {args.time_size}, 2 gloo ranks, inductor, median of {n}): "
            f"CPU {timing['cpu_ratio_median']:.2f}x, wall {timing['wall_ratio_median']:.2f}x "
            f"(eager step {timing['eager_wall_ms_median']:.0f} ms)"
        )
    path = write_result(
        "comm",
        {
            "size": args.size,
            "configs": rows,
            "goal_met": ok,
            "compile_timing": timing,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0 if ok or args.size not in ("full", "tiny") else 1


if __name__ == "__main__":
    sys.exit(main())
