"""Smoke test of the benchmark scripts in their tiny mode: they run, print ratios and write JSON.

Times are never asserted (the machine is shared and noisy); byte counts are exact, so the memory
figures are checked against their goal and the `shardcore plan` estimate.
"""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest
import torch

import harness
from harness import ROOT  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    out = harness.python(ROOT / "bench" / script, *args, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def test_overhead_tiny_prints_the_ratio(tmp_path):
    res = tmp_path / "overhead.json"
    out = _run("overhead.py", "--size", "tiny", "--steps", "2", "--warmup", "1", "--out", str(res))
    m = re.search(r"ratio shardcore/hand-written (\d+\.\d+)", out.stdout)
    assert m, out.stdout
    data = json.loads(res.read_text())
    r = data["results"][0]
    assert r["backend"] == "fsdp2" and r["world_size"] == 2 and r["step_s"]["shardcore"]["n"] == 2
    assert math.isfinite(r["ratio_of_medians"]) and r["ratio_of_medians"] > 0
    assert abs(float(m.group(1)) - r["ratio_of_medians"]) < 1e-3
    assert {"cpu", "cores", "torch"} <= set(data["machine"])


def test_memory_tiny_matches_goal_and_estimate(tmp_path):
    res = tmp_path / "memory.json"
    out = _run("memory.py", "--sizes", "tiny", "--world-sizes", "2", "--out", str(res))
    assert "ratio to full/world" in out.stdout
    row = json.loads(res.read_text())["runs"][0]["rows"][0]
    assert row["world_size"] == 2 and len(row["per_rank_bytes"]) == 2
    # a byte count, not a time: sharding must actually halve every kind of state
    for kind in ("params", "grads", "adamw_state", "total"):
        assert 0.99 <= row["ratio_to_ideal"][kind] <= 1.02, (kind, row)
        assert abs(row["estimate_over_measured"][kind] - 1) < 0.02, (kind, row)


@pytest.mark.skipif(
    torch.accelerator.is_available(), reason="on an accelerator machine gpu.py runs the full benchmarks"
)
def test_gpu_script_without_an_accelerator_says_so_and_exits_0():
    out = _run("gpu.py", timeout=120)
    assert "no accelerator here" in out.stdout


@pytest.mark.xla
def test_overhead_xla_tiny_compares_both_modes_without_recompiling(tmp_path):
    res = tmp_path / "overhead.json"
    out = _run(
        "overhead.py", "--only-xla", "--size", "tiny", "--steps", "2", "--warmup", "2", "--out", str(res), timeout=600
    )
    results = {r["backend"]: r for r in json.loads(res.read_text())["results"]}
    assert set(results) == {"xla", "xla-fsdp"}, out.stdout
    fsdp = results["xla-fsdp"]
    assert fsdp["devices"] == 2 and fsdp["step_s"]["shardcore"]["n"] == 2
    assert math.isfinite(fsdp["cpu_ratio_of_medians"]) and fsdp["cpu_ratio_of_medians"] > 0
    assert fsdp["compiles_after_warmup"] == 0, fsdp  # a count: every timed step reuses the warm-up's graphs
    assert "compilations after warm-up 0" in out.stdout


def test_accumulation_counts_one_reduction_per_unit_with_no_sync(tmp_path):
    """Counts, not times: with shardcore.no_sync each unit reduce-scatters once per optimizer step,
    without it once per micro-batch, on FSDP2 and (when installed) XLA FSDP; both variants train to
    the same parameters."""
    xla = True
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        xla = False
    res = tmp_path / "accumulation.json"
    out = _run(
        "accumulation.py",
        "--size",
        "tiny",
        "--accum",
        "3",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(res),
        *(["--xla"] if xla else []),
        timeout=900,
    )
    results = json.loads(res.read_text())["results"]
    assert len(results) == (2 if xla else 1), out.stdout
    for r in results:
        assert r["units"] == 3, r  # 2 decoder layers and the root
        n = r["reductions_per_backward"]
        # FSDP2: one per unit; XLA FSDP: one per parameter (9 per decoder layer, 3 in the root)
        assert n == (3 if r["backend"] == "fsdp2" else 21), r
        assert r["calls_per_optimizer_step"] == {"no_sync": n, "every": 3 * n}, r
        assert math.isfinite(r["cpu_ratio_no_sync_over_every"]) and r["cpu_ratio_no_sync_over_every"] > 0
        assert r["max_param_diff"] < 1e-5, r
    assert "cpu-time ratio no_sync/every" in out.stdout


def test_comm_tiny_moves_the_zero3_minimum_in_every_config(tmp_path):
    """Bytes are exact: every config (reshard on and off, bf16 parameters, HSDP 2x2, and tensor
    parallelism alone, under FSDP and under HSDP) moves what ZeRO-3 (and Megatron's TP) must per
    optimizer step, at the tiny Llama whose dim-0 sizes divide the shard counts;
    the compiled-vs-eager timing runs and reports a ratio (never asserted)."""
    res = tmp_path / "comm.json"
    out = _run(
        "comm.py",
        "--size",
        "tiny",
        "--steps",
        "2",
        "--time-size",
        "tiny",
        "--time-steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(res),
    )
    doc = json.loads(res.read_text())
    assert set(doc["configs"]) == {"reshard", "no_reshard", "bf16_params", "hsdp_2x2", "tp2", "dp2_tp2", "hsdp2_tp2"}
    for name, row in doc["configs"].items():
        assert row["ratio"] == 1.0 and len(row["bytes_per_step"]) == 1, (name, row)
    calls = {n: r["calls_per_step"] for n, r in doc["configs"].items()}
    # tensor parallelism over pairs, per decoder layer: 2 outputs summed in forward, 2 input gradients
    # (q, k, v share one) in backward; the embedding's output, the head's input gradient; the head's
    # output gathered. FSDP's gathers and reduce-scatters only where dp_shard > 1.
    assert calls["tp2"] == {"all_gather": 1, "reduce_scatter": 0, "all_reduce": 2 * 4 + 2}
    assert calls["dp2_tp2"]["all_reduce"] == 10 and calls["dp2_tp2"]["reduce_scatter"] == 3
    assert calls["hsdp2_tp2"]["all_reduce"] == 10 + 3  # and the replicas' all-reduce per unit
    assert calls["reshard"] == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 0}  # root gathered once
    assert calls["no_reshard"]["all_gather"] == 3 and calls["hsdp_2x2"]["all_reduce"] == 3
    assert doc["goal_met"] and "goal 1.00 +- 0.01: met" in out.stdout
    t = doc["compile_timing"]
    assert math.isfinite(t["cpu_ratio_median"]) and t["cpu_ratio_median"] > 0


def test_memory_of_a_lora_model_keeps_no_state_for_the_frozen_base(tmp_path):
    """A PEFT LoRA model: the base is sharded like any weights, but only the adapters have gradients and
    AdamW state (the optimizer over the trainable parameters), and the estimate agrees."""
    res = tmp_path / "memory.json"
    out = _run("memory.py", "--sizes", "tiny", "--world-sizes", "2", "--lora", "4", "--out", str(res))
    r = json.loads(res.read_text())["runs"][0]
    row = r["rows"][0]
    assert "LoRA r=4" in out.stdout and 0 < r["model"]["trainable_params"] < r["model"]["params"] / 10
    for kind in ("params", "grads", "adamw_state", "total"):
        assert 0.99 <= row["ratio_to_ideal"][kind] <= 1.02, (kind, row)
        assert abs(row["estimate_over_measured"][kind] - 1) < 0.02, (kind, row)
    fb = row["frozen_base"]
    assert fb["grads_and_adamw_bytes"] < fb["full_fine_tuning_bytes"] / 10, fb


def test_checkpoint_tiny_times_both_modes_and_counts_the_staged_bytes(tmp_path):
    res = tmp_path / "checkpoint.json"
    out = _run("checkpoint.py", "--size", "tiny", "--repeats", "1", "--out", str(res))
    data = json.loads(res.read_text())
    params = data["params"]
    for kind, line in zip(("FULL_STATE_DICT", "SHARDED_STATE_DICT"), out.stdout.splitlines()[-3:-1]):
        r = data["kinds"][kind]
        assert line.startswith(kind) and "async/sync" in line, out.stdout
        assert r["sync_blocked_s"] > 0 and 0 < r["async_blocked_s"] <= r["async_done_s"] * 1.0001
        # bytes, not times: each rank holds its shards of the fp32 state (weights and AdamW's two
        # moments), about half of it; for FULL rank 0 also gathers the whole of it
        staged = r["staged_bytes_per_rank"]
        whole = params * 4 * 3
        shards = [b - (whole if kind == "FULL_STATE_DICT" and rank == 0 else 0) for rank, b in enumerate(staged)]
        assert abs(sum(shards) - whole) <= 64 * 4 * 3, staged
