"""How close ``shardcore plan``'s predicted peak comes to the peak a real run reaches.

For each configuration: the prediction (``shardcore.planning.predict``: one process, fake tensors, a
fake process group), then the real run: ``world_size`` processes over gloo, the same model built
from the same config.json with real weights, sharded by ``shardcore.shard``, two AdamW steps of the
same micro-batch and the same AdamW (``foreach``), each step followed by torch's
``FSDPMemTracker`` in real mode (every tensor storage a rank holds, by what it is; the planner's
variant that keeps only the global peak). The measured peak is the largest rank's; under
``cpu_offload`` both sides take the host-held state (sharded parameters, gradients, optimizer
state) out of the device's share the same way. The ratio predicted / measured has the goal
1.00 +- 0.10 for the steady and the first step.

    python bench/plan_accuracy.py --out results/plan_accuracy.json     # about 4 minutes on 2 cores

On an accelerator machine it plans for that device and measures one device with the allocator's
own peak (``torch.accelerator.max_memory_allocated``), independent of the tracker.

    python bench/plan_accuracy.py --cuda-standin    # seconds; results/plan_accuracy_cuda_standin.json

replans, on this CPU, the recorded H200 rows whose attention kernel the CPU can run as CUDA did, with
CUDA's kernel temporaries and the H200's cuBLAS workspaces (``shardcore.workspaces``), and compares
them with the peaks the H200 measured (``results/plan_accuracy_cuda.json``): the CUDA plan as the
current planner makes it, where no GPU is lent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, run_ranks, write_result  # noqa: E402

MODELS = Path(__file__).resolve().parent / "plan_models"
#: (name, model directory, world size, config, micro-batch, sequence length[, attention kernel])
CONFIGS = [
    ("llama-ws2", "llama-small", 2, {}, 4, 128),
    ("llama-ws2-ac", "llama-small", 2, {"activation_checkpointing": True}, 4, 128),
    ("llama-ws2-noreshard", "llama-small", 2, {"reshard_after_forward": False}, 4, 128),
    ("llama-ws2-bf16", "llama-small", 2, {"mixed_precision": "bf16"}, 4, 128),
    ("llama-ws2-offload", "llama-small", 2, {"cpu_offload": True}, 4, 128),
    ("llama-ws4", "llama-small", 4, {}, 4, 128),
    ("llama-ws4-hsdp2x2", "llama-small", 4, {"dp_replicate_size": 2}, 4, 128),
    # tensor parallelism: pure TP on 2 ranks, dp_shard 2 x tp 2 on 4, and with activation checkpointing
    ("llama-ws2-tp2", "llama-small", 2, {"tp_size": 2}, 4, 128),
    ("llama-ws4-tp2", "llama-small", 4, {"tp_size": 2}, 4, 128),
    ("llama-ws4-tp2-ac", "llama-small", 4, {"tp_size": 2, "activation_checkpointing": True}, 4, 128),
    ("gpt2-ws2", "gpt2-small", 2, {}, 4, 128),
    ("gpt2-ws2-ac", "gpt2-small", 2, {"activation_checkpointing": True}, 4, 128),
    ("gpt2-ws4-bf16-noreshard", "gpt2-small", 4, {"mixed_precision": "bf16", "reshard_after_forward": False}, 4, 128),
    # the attention CUDA runs for fp32 Llama (grouped KV heads: neither flash nor memory-efficient
    # attention takes it), at the CUDA rows' size: (8, 8, 512, 512) score matrices of 64 MiB per layer
    ("llama-ws1-8x512-math", "llama-small", 1, {}, 8, 512, "math"),
    ("llama-ws1-8x512-ac-math", "llama-small", 1, {"activation_checkpointing": True}, 8, 512, "math"),
]
TOLERANCE = 0.10
#: steps each rank records with the profiler; the least peak counts (see ``allocation_peak``)
ALLOCATOR_STEPS = 3
#: on an accelerator (--accelerator): one device, measured by its allocator's own peak
#: (torch.accelerator.max_memory_allocated), a measure independent of the tracker the plan uses
ACCELERATOR_CONFIGS = [
    ("llama-dev1", "llama-small", 1, {}, 8, 512),
    ("llama-dev1-ac", "llama-small", 1, {"activation_checkpointing": True}, 8, 512),
    ("llama-dev1-bf16", "llama-small", 1, {"mixed_precision": "bf16"}, 8, 512),
    ("gpt2-dev1", "gpt2-small", 1, {}, 8, 512),
]

#: recorded H200 rows (``ACCELERATOR_CONFIGS``) whose attention the CPU runs with CUDA's kernel: fp32
#: Llama has grouped KV heads, which neither flash nor memory-efficient attention takes, so CUDA runs
#: math attention. GPT-2's memory-efficient and bf16's cuDNN attention have no CPU kernel.
CUDA_STANDIN = {"llama-dev1": "math", "llama-dev1-ac": "math"}
#: compute capabilities by device name, for records made before the bench wrote the capability
#: (the H200 run of 2026-12-04); it sets the cuBLAS workspace size
KNOWN_CAPABILITY = {"NVIDIA H200": (9, 0)}


def kernel(attention: str | None):
    """Attention forced to one SDPA kernel (``None``: torch's own choice), for plan and run alike."""
    if attention is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"math": SDPBackend.MATH}[attention])


def build(model_dir: str):
    from shardcore.cli import load_model

    return lambda: load_model(str(MODELS / model_dir), meta=False)


def measure_rank(
    rank: int, world_size: int, model_dir: str, config: dict, batch: int, seq: int, attention: str | None = None
) -> list[dict]:
    """One rank's parts at its peak, per step (first, steady), as the planner groups them."""
    with kernel(attention):
        return _measure_rank(rank, model_dir, config, batch, seq)


def _measure_rank(rank: int, model_dir: str, config: dict, batch: int, seq: int) -> list[dict]:
    import shardcore
    from shardcore.planning import HOST_PARTS, _optimizer, _parts, peak_tracker

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = shardcore.shard(build(model_dir)(), config)
    opt = _optimizer([p for p in model.parameters() if p.requires_grad], "adamw")  # the planned optimizer
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(rank))
    steps = []
    for _ in range(2):
        # under cpu_offload the device's share at its own peak, as the plan takes it
        with peak_tracker(model, opt, HOST_PARTS if config.get("cpu_offload") else ()) as tracker:
            tracker.track_inputs((ids,))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            parts = _parts(tracker.get_tracker_snapshot("peak"), "cpu")
            steps.append({k: v for k, v in parts.items() if not (config.get("cpu_offload") and k in HOST_PARTS)})
    # then steps seen by the allocator instead: the profiler's record of every CPU allocation and
    # free (kernels' own buffers included) over what the rank held when the step began, a measure
    # independent of the tracker
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    held = _storage_bytes([*model.parameters(), *model.buffers(), *state])
    peaks = []
    for _ in range(ALLOCATOR_STEPS):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with tempfile.TemporaryDirectory() as tmp:
            # the chrome trace, as only it gives each allocation's address
            prof.export_chrome_trace(f"{tmp}/trace.json")
            trace = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
        peaks.append(held + allocation_peak(trace))
    # a record can only count a buffer too long (see allocation_peak), so the least is the closest
    steps.append({"allocator": min(peaks), "allocator_steps": peaks})
    return steps


def allocation_peak(trace: list[dict]) -> int:
    """The peak of live bytes over a profiler trace's ``[memory]`` events, with the frees the profiler
    could not see. It records only the threads that run the profiled code, and gloo frees on its worker
    threads whatever its work held last:
    - Gloo's reduce-scatter clones its input inside the collective. An allocation made inside a
      ``c10d::`` collective with no free of its own ends with that collective: its result has been
      copied out, and only gloo's work still holds it.
    - DTensor's functional collectives hand their buffers to gloo's work and back to the caller. An
      address handed out again proves the free before it; without one, the buffer counts to the end.
    So a record can count a buffer too long, never too short. Counted to the step's end, the clones
    added one or two decoder layers (9-18%) to the activation-checkpointed Llama row's peak in 2 of 4
    steps per rank on an idle machine (2026-12-07)."""
    memory = sorted(
        (e["ts"], e["args"]["Bytes"], e["args"]["Addr"], e["tid"]) for e in trace if e.get("name") == "[memory]"
    )
    collectives = [
        (e["tid"], e["ts"], e["ts"] + e.get("dur", 0))
        for e in trace
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("c10d::")
    ]

    def collective_end(ts: float, tid) -> float | None:
        ends = [end for t, start, end in collectives if t == tid and start <= ts <= end]
        return min(ends) if ends else None

    deltas: list[tuple[float, int]] = []
    live: dict[int, tuple[float, int, object]] = {}  # address -> (allocated at, bytes, thread)

    def unseen_free(addr: int, fallback: float) -> None:
        at, n, tid = live.pop(addr)
        deltas.append((collective_end(at, tid) or fallback, -n))

    for ts, n, addr, tid in memory:
        deltas.append((ts, n))
        if n > 0:
            if addr in live:
                unseen_free(addr, ts)
            live[addr] = (ts, n, tid)
        else:
            live.pop(addr, None)
    end = memory[-1][0] if memory else 0
    for addr in list(live):
        if collective_end(live[addr][0], live[addr][2]) is not None:
            unseen_free(addr, end)
    running = peak = 0
    # at one instant, frees before allocations: the clone's end and the next buffer do not overlap
    for _, n in sorted(deltas):
        running += n
        peak = max(peak, running)
    return peak


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard)."""
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def end_row() -> None:
    """Frees what a measured row left, before the next one: its process group (the next config plans
    in a fake group of its own) and its model. FSDP2's modules hold reference cycles, so a sharded
    model's parameters outlive ``del`` until Python's collector runs; on the H200 (2026-12-04, before
    this) the checkpointed row's peak counted the previous row's 15.07 MiB of parameters."""
    import gc

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()


def measure_allocator(model_dir: str, config: dict, batch: int, seq: int) -> tuple[list[int], int]:
    """On one accelerator: the allocator's peak in each step (first, steady): everything the device
    holds, as the plan's peak counts every tensor of the rank. Also what the device held before the
    model was built (earlier rows' BLAS workspaces, which the plan counts too)."""
    import shardcore
    from shardcore.planning import _optimizer

    torch.manual_seed(0)
    end_row()
    before = torch.accelerator.memory_allocated()  # the current device, where shard() puts the model
    model = shardcore.shard(build(model_dir)(), config)
    device = next(model.parameters()).device
    opt = _optimizer([p for p in model.parameters() if p.requires_grad], "adamw")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    peaks = []
    for _ in range(2):
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats(device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.accelerator.synchronize()
        peaks.append(torch.accelerator.max_memory_allocated(device))
    del model, opt, ids
    end_row()
    return peaks, before


def run(
    name: str, model_dir: str, world_size: int, config: dict, batch: int, seq: int, attention: str | None = None
) -> dict:
    from shardcore.planning import predict

    with kernel(attention):
        plan = predict(build(model_dir), config, world_size, batch, seq)
    allocator = None  # on the CPU under cpu_offload the allocator cannot tell host from device
    before = allocator_steps = None
    if plan.device != "cpu":
        measured, before = measure_allocator(model_dir, config, batch, seq)
        allocator = measured[1]
    else:
        per_rank = run_ranks(measure_rank, world_size, (model_dir, config, batch, seq, attention), timeout_s=900)
        measured = [max(sum(r[i].values()) for r in per_rank) for i in (0, 1)]
        allocator = None if config.get("cpu_offload") else max(r[2]["allocator"] for r in per_rank)
        allocator_steps = None if allocator is None else [r[2]["allocator_steps"] for r in per_rank]
    return {
        "name": name,
        "device": plan.device,
        "measured_by": "max_memory_allocated" if plan.device != "cpu" else "FSDPMemTracker (real tensors)",
        "model": model_dir,
        "world_size": world_size,
        "config": config,
        "attention": attention or "torch's choice",
        "batch_size": batch,
        "seq_len": seq,
        "predicted_peak_bytes": plan.peak_bytes,
        "measured_peak_bytes": measured[1],
        "ratio": plan.peak_bytes / measured[1],
        "predicted_first_step_peak_bytes": plan.first_step_peak_bytes,
        "measured_first_step_peak_bytes": measured[0],
        "first_step_ratio": plan.first_step_peak_bytes / measured[0],
        "measured_allocator_peak_bytes": allocator,
        "measured_allocator_steps_per_rank": allocator_steps,
        "allocated_before_bytes": before,
        "allocator_ratio": plan.peak_bytes / allocator if allocator else None,
        "predicted_breakdown": plan.breakdown,
        "plan_seconds": round(plan.seconds, 2),
    }


def cuda_standin(names: set[str] | None = None) -> list[dict]:
    """The recorded GPU rows of :data:`CUDA_STANDIN`, planned on this CPU as on that GPU: the same
    attention kernel, CUDA's kernel temporaries, and the cuBLAS workspaces of the threads that ran
    GEMMs at the GPU's compute capability, against the peaks measured there."""
    from shardcore import workspaces
    from shardcore.config import parse_config
    from shardcore.planning import _fsdp2_plan

    recorded = json.loads((RESULTS / "plan_accuracy_cuda.json").read_text())
    machine = recorded["machine"]
    capability = machine.get("accelerator_capability") or KNOWN_CAPABILITY.get(machine.get("accelerator_name"))
    if capability is None:
        raise SystemExit(
            f"results/plan_accuracy_cuda.json was recorded on {machine.get('accelerator_name')!r} without its "
            "compute capability, which sets the cuBLAS workspace size; rerun bench/plan_accuracy.py on that GPU."
        )
    rows = []
    for r in recorded["rows"]:
        attention = CUDA_STANDIN.get(r["name"])
        if attention is None or (names is not None and r["name"] not in names):
            continue
        cfg = parse_config(r["config"])
        with kernel(attention):  # CUDA's kernel rules lent to the CPU, whose kernels take no such temporaries
            ((first, _), (steady, _)), _, threads = _fsdp2_plan(
                build(r["model"]),
                cfg,
                r["world_size"],
                r["batch_size"],
                r["seq_len"],
                "adamw",
                kernel_scratch=workspaces.KERNEL_SCRATCH["cuda"],
            )
        blas = workspaces.workspace_bytes(threads, tuple(capability), {})
        predicted, predicted_first = sum(steady.values()) + blas, sum(first.values()) + blas
        rows.append(
            {
                "name": r["name"],
                "device": "cpu standing in for cuda",
                "measured_by": f"max_memory_allocated on {machine.get('accelerator_name')}, {recorded['when']}",
                "model": r["model"],
                "world_size": r["world_size"],
                "config": r["config"],
                "attention": attention,
                "batch_size": r["batch_size"],
                "seq_len": r["seq_len"],
                "predicted_peak_bytes": predicted,
                "measured_peak_bytes": r["measured_peak_bytes"],
                "ratio": predicted / r["measured_peak_bytes"],
                "predicted_first_step_peak_bytes": predicted_first,
                "measured_first_step_peak_bytes": r["measured_first_step_peak_bytes"],
                "first_step_ratio": predicted_first / r["measured_first_step_peak_bytes"],
                "measured_allocator_peak_bytes": r["measured_peak_bytes"],
                "allocator_ratio": predicted / r["measured_peak_bytes"],
                "predicted_breakdown": {**steady, "blas_workspaces": blas},
                "recorded_prediction_then": r["predicted_peak_bytes"],
                # what the device held before the row's model was built (recorded since 2026-12-04's fix)
                "recorded_allocated_before_bytes": r.get("allocated_before_bytes"),
            }
        )
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        f"{'config':<26} {'predicted':>12} {'measured':>12} {'ratio':>7} {'1st-step ratio':>15} {'allocator ratio':>16}"
    ]
    for r in rows:
        alloc = f"{r['allocator_ratio']:.3f}" if r["allocator_ratio"] else "-"
        lines.append(
            f"{r['name']:<26} {r['predicted_peak_bytes'] / 2**20:>9.2f} MiB {r['measured_peak_bytes'] / 2**20:>9.2f} MiB "
            f"{r['ratio']:>7.3f} {r['first_step_ratio']:>15.3f} {alloc:>16}"
        )
    worst = max(max(abs(r["ratio"] - 1), abs(r["first_step_ratio"] - 1)) for r in rows)
    lines.append(f"largest |ratio - 1|: {worst:.3f} (goal <= {TOLERANCE})")
    allocs = [abs(r["allocator_ratio"] - 1) for r in rows if r["allocator_ratio"]]
    if allocs:
        lines.append(f"largest |allocator ratio - 1|: {max(allocs):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="result JSON (default bench/results/plan_accuracy.json)")
    ap.add_argument("--only", default=None, help="comma-separated config names")
    ap.add_argument(
        "--cuda-standin", action="store_true", help="replan the recorded GPU rows here (see above); no GPU needed"
    )
    args = ap.parse_args(argv)
    names = set(args.only.split(",")) if args.only else None
    if args.cuda_standin:
        rows = cuda_standin(names)
        print(report(rows), flush=True)
        path = write_result("plan_accuracy_cuda_standin", {"tolerance": TOLERANCE, "rows": rows}, args.out)
        print(f"written: {path}")
        return 0
    from _common import device_type

    configs = ACCELERATOR_CONFIGS if device_type() != "cpu" else CONFIGS
    rows = [run(*c) for c in configs if names is None or c[0] in names]
    print(report(rows), flush=True)
    path = write_result("plan_accuracy", {"tolerance": TOLERANCE, "rows": rows}, args.out)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
