"""``shardcore-conformance`` end to end, each run in new processes: the report files, broken
backends caught, HSDP on four ranks, known gaps (xfails), case timeouts, an out-of-tree backend
package installed and run by its entry-point name, and the suite on CUDA. The runs use a few cases;
the full FSDP2 matrix runs once, through the command, and two tests read it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardcore.devices import cpu_name
from shardcore_conformance import TOLERANCES, fsdp2_matrix

import harness

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLI = str(BIN / "shardcore-conformance")


# ------------------------------------------------------------------------------ the CLI, for real


def _run(args, env_extra=None, timeout=420):
    env = harness.clean_env()
    extra = dict(env_extra or {})
    # a vendor site directory first where given (clean_env puts tests/ on the path for the fixtures)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra.pop("PYTHONPATH", ""), env["PYTHONPATH"]) if p)
    env.update(extra)
    return harness.run([CLI, *args], env=env, timeout=timeout)


def _summary(out, verdict: str, counts: str, extra: str = "") -> bool:
    """The run's last line: ``PASS: fsdp2 on 2 x <device name>: 5/5 passed in 12s; report: ...``."""
    return (
        re.search(
            rf"^{verdict}: \S+ on \d+ x .+: {counts} passed{re.escape(extra)}(; .+ not observable on \S+)? in \d+s; report: ",
            out.stdout,
            re.M,
        )
        is not None
    )


@pytest.fixture(scope="module")
def fsdp2_matrix_run(tmp_path_factory):
    """The whole FSDP2 matrix at 2 ranks, once, through the command a vendor runs; the tests below
    read its output and report (one launch where there were two)."""
    report = tmp_path_factory.mktemp("fsdp2-matrix")
    # The CLI kills a case that hangs (--case-timeout). This deadline only catches a hang of the runner
    # itself, so it must outlast all 200 runs on a slow, shared machine: CI once needed over 420 s.
    args = ["--backend", "fsdp2", "--world-size", "2", "--report", str(report), "--case-timeout", "180"]
    out = _run(args, timeout=1800)
    return out, report


@pytest.mark.multiprocess
def test_fsdp2_matches_single_device_on_every_case(fsdp2_matrix_run):
    out, report = fsdp2_matrix_run
    cases = fsdp2_matrix()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((report / "report.json").read_text())
    assert doc["ok"] and [r["case"] for r in doc["cases"]] == [c.name for c in cases] and len(cases) >= 20
    # the comparison compared something: every case trained and moved
    for r in doc["cases"]:
        assert r["ok"] and len(r["sharded_losses"]) == 5 and r["sharded_losses"][0] != r["sharded_losses"][-1], r
        # communication is checked in every FSDP2 case, and gradients were reduced
        assert r["comm_checked"] and r["comm"]["reduce_scatter"]["count"] + r["comm"]["all_reduce"]["count"], r["case"]
        compiled = r["config"].get("torch_compile", False)
        assert (
            (r["compiled_graphs"][0] > 0 and not any(r["compiled_graphs"][1:]))
            if compiled
            else not any(r["compiled_graphs"])
        ), (r["case"], r["compiled_graphs"])
    assert "## Communication" in (report / "report.md").read_text()


@pytest.mark.multiprocess
def test_cli_runs_cases_and_writes_the_report(fsdp2_matrix_run):
    out, tmp_path = fsdp2_matrix_run
    n = len(fsdp2_matrix())
    pattern = "mlp-transformer-reshard1-ac0,gpt2-transformer-reshard0-ac1,frozen-mlp,buffers-mlp,uneven-mlp,grad_accum-mlp,lr_schedule-mlp,mlp-mp-bf16"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _summary(out, "PASS", f"{n}/{n}")
    assert f"[{2 * n}/{2 * n}" in out.stderr and "fsdp2 buffers-mlp PASS" in out.stderr  # progress and verdicts

    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["ok"] and doc["backend"] == "fsdp2" and doc["world_size"] == 2 and doc["passed"] == n
    # what it certifies: the CPU (no accelerator here), each rank's device, the software
    unobservable = "; cpu_offload, torch_compile_backend, torch_compile_dynamic, torch_compile_fullgraph, "
    unobservable += "torch_compile_mode, torch_compile_regional, use_cpu not observable on cpu"
    assert doc["device_type"] == "cpu" and doc["headline"] == f"fsdp2 on 2 x {cpu_name()}: {n}/{n} passed{unobservable}"
    # what each key did, observed: every key FSDP2 supports has a check, or the reason it cannot be seen here
    ev = doc["evidence"]
    assert sorted(ev) == doc["supported_keys"]
    assert "recomputation" in ev["activation_checkpointing"]["observed_by"]
    assert {"communication", "compute dtype"} <= set(ev["mixed_precision"]["observed_by"])
    assert ev["state_dict_type"]["observed_by"] == ["resume"]
    assert ev["cpu_ram_efficient_loading"]["observed_by"] == ["rank 0's weights"]
    assert ev["timeout"]["observed_by"] == ["process-group timeout"]
    assert {"communication", "numbers"} <= set(ev["dp_replicate_size"]["observed_by"])
    assert ev["torch_compile"]["observed_by"] == ["compilation"]
    assert "communication" in ev["reshard_after_forward"]["observed_by"]
    for k in ("auto_wrap_policy", "min_num_params"):  # which modules recompute is which modules are in units
        assert {"communication", "recomputation"} <= set(ev[k]["observed_by"]), k
    assert "communication" in ev["transformer_layer_cls_to_wrap"]["observed_by"]
    for k, e in ev.items():  # observed, or said why not: never both, never neither
        assert bool(e["observed_by"]) != bool(e["unobservable"]), (k, e)
    assert ev["cpu_offload"]["unobservable"].startswith("the run's device is the CPU")
    md = (tmp_path / "report.md").read_text()
    assert "## Evidence" in md and "| `activation_checkpointing` | recomputation |" in md
    resumed = [r for r in doc["cases"] if r["config"].get("state_dict_type") or r["case"] == "llama-resume"]
    assert len(resumed) >= 3 and all(r["resume_at"] == 2 for r in resumed), resumed
    assert [(h["type"], h["name"]) for h in doc["hardware"]] == [("cpu", cpu_name())] * 2
    assert {"torch", "transformers"} <= set(doc["versions"])
    for r in doc["cases"]:  # every case said where it ran, and a tp case how it split its weights
        want = "cpu"
        split = r["placement"].pop("tp_split", None)
        assert r["placement"] == {"batch": [want], "loss": want, "params": [want], "grads": [want]}, r["case"]
        assert bool(split) == ("tp_size" in r["config"]), r["case"]
    assert doc["tolerances"]["fp32"]["param_atol"] == TOLERANCES["fp32"].param_atol
    rows = {r["case"]: r for r in doc["cases"]}
    assert set(rows) >= set(pattern.split(","))
    for name in pattern.split(","):
        r = rows[name]
        tol = TOLERANCES[r["dtype"]]
        assert r["ok"] and len(r["sharded_losses"]) == len(r["reference_losses"]) == 5, name
        assert 0 <= r["max_param_diff"] <= tol.param_atol and 0 <= r["max_output_diff"] <= tol.output_atol, name
        assert r["checkpoint_param_diff"] == 0.0 and r["checkpoint_method"], name
        assert r["sharded_losses"][0] != r["sharded_losses"][-1], name  # it trained
    assert rows["frozen-mlp"]["frozen_params"] == [
        "blocks.0.fc.weight",
        "blocks.0.fc.bias",
        "blocks.0.norm.weight",
        "blocks.0.norm.bias",
        "head.bias",
    ]
    lrs = rows["lr_schedule-mlp"]["lrs"]
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[2]  # warm-up, then decay
    assert doc["families"]["frozen"]["passed"] == sum(c.family == "frozen" for c in fsdp2_matrix())

    md = (tmp_path / "report.md").read_text()
    assert (
        f"**PASS**: fsdp2 on 2 x {cpu_name()}: {n}/{n} passed" in md
        and "| frozen-mlp | fp32 | pass |" in md
        and "| bf16 |" in md
    )
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert {p.name for p in pngs} >= {"loss-mlp.png", "loss-frozen.png", "loss-mixed_precision.png"}
    assert sorted(doc["plots"]) == [str(p.relative_to(tmp_path)) for p in pngs]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
        assert f"]({p.relative_to(tmp_path).as_posix()})" in md


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backend, case, expected",
    [
        ("broken_backends:SumGradsBackend", "grad_accum-mlp", "gradient norm differs at step 0"),
        ("broken_backends:WrongSliceBackend", "grad_accum-mlp", "loss differs at step 0"),
        ("broken_backends:LocalNormClippingBackend", "clip-llama", "clipping norm differs at step 0"),
        # 2 replicas of 1 shard: each replica's rank trains on its own rows; without the all-reduce they drift
        ("broken_backends:SkipsReplicaAllReduceBackend", "hsdp2x1-mlp", "loss differs at step 1"),
        # every rank built without weights reads rank 0's rows: the model starts from wrong weights
        ("broken_backends:SlicesFromRowZeroBackend", "llama-empty_weights", "loss differs at step 0"),
        # a rank that native code aborts writes no error; its peers' "connection closed" must not hide it
        ("broken_backends:AbortsOnRankOneBackend", "grad_accum-mlp", "rank 1 was killed by SIGABRT"),
        # numbers right, communication wrong: only the communication check may fail these two
        (
            "broken_backends:WholeModelUnitBackend",
            "llama-transformer-reshard1-ac0",
            "communication differs at step 0 on rank 0: 1 all_gather calls, expected 5",
        ),
        (
            "broken_backends:NoSyncStillReducesBackend",
            "grad_accum-llama",
            "communication differs at step 0 on rank 0: 6 reduce_scatter calls, expected 3",
        ),
    ],
)
def test_cli_catches_broken_backends(tmp_path, backend, case, expected):
    out = _run(["--backend", backend, "--cases", case, "--report", str(tmp_path), "--no-plots"])
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith(f"FAIL {case}: ")]
    assert expected in line, line
    if "SumGrads" in backend:
        assert "are gradients averaged across ranks?" in line
    assert _summary(out, "FAIL", "0/1")
    doc = json.loads((tmp_path / "report.json").read_text())
    assert not doc["ok"] and any(expected in r for r in doc["cases"][0]["reasons"])
    assert "## Failures" in (tmp_path / "report.md").read_text()
    if expected.startswith("communication"):
        (row,) = doc["cases"]
        assert all(r.startswith("communication differs") for r in row["reasons"]), row["reasons"]
        assert row["max_param_diff"] <= row["tolerance"]["param_atol"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backend, cases, check, key",
    [
        # each accepts a key and ignores it; numbers and collectives stay right, so only the check that
        # observes the key's effect may fail, and its message names the key
        (
            "IgnoresActivationCheckpointingBackend",
            "llama-transformer-reshard1-ac1,multi_output-mlp-ac1",
            "recomputation differs in step 0 on rank 0: ",
            "activation_checkpointing is set",
        ),
        ("IgnoresTimeoutBackend", "mlp-timeout", "timeout differs: ", "the config's 'timeout' is 600s"),
        (
            "IgnoresRank0WeightsBackend",
            "llama-cpu_ram_efficient_loading",
            "cpu_ram_efficient_loading is set, so rank 0's weights are the ones sharded",
            "cpu_ram_efficient_loading",
        ),
        (
            "WritesAsyncSavesNowBackend",
            "llama-async_save-sharded",
            "background save differs: ",
            "async_save is set, but rank(s) [0, 1] wrote the model's checkpoint files before save() returned",
        ),
        (
            "DropsOptimizerStateBackend",
            "llama-resume,llama-sharded_state_dict",
            "resuming diverged: ",
            "does the checkpoint hold the optimizer state",
        ),
    ],
)
def test_suite_catches_a_backend_that_ignores_a_key(backend, cases, check, key):
    """In this process (its fork server serves every run), not through the command: the command's
    FAIL lines and exit status are the subject of test_cli_catches_broken_backends."""
    from shardcore_conformance import run_suite, select

    chosen = select(fsdp2_matrix(), cases)
    assert [c.name for c in chosen] == cases.split(",")
    result = run_suite(chosen, f"broken_backends:{backend}", world_size=2, plots=False)
    assert not result.ok and len(result.verdicts) == len(chosen)
    for v in result.verdicts:
        assert not v.ok and v.reasons[0].startswith(check) and key in v.reasons[0], (v.case, v.reasons)
        if "resum" not in check and "rank 0" not in check:  # nothing else differed
            assert len(v.reasons) == 1 and v.max_param_diff <= v.tolerance["param_atol"], (v.case, v.reasons)


@pytest.mark.multiprocess
def test_hsdp_on_four_ranks_matches_and_a_missing_replica_all_reduce_is_caught(tmp_path):
    """HSDP 2 replicas x 2 shards on 4 gloo ranks: every hsdp case (MLP, Llama, GPT-2, reshard off,
    accumulation, clipping, SHARDED checkpoint, compiled units, 4 x 1 replication) matches the
    single-device run and communicates as predicted;
    the same 2x2 cases fail on a backend that skips the replica all-reduce."""
    out = _run(
        ["--backend", "fsdp2", "--world-size", "4", "--cases", "hsdp*", "--report", str(tmp_path / "ok"), "--no-plots"]
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "ok" / "report.json").read_text())
    names = {c["case"] for c in doc["cases"]}
    assert {"hsdp2x2-llama", "hsdp2x2-grad_accum-llama", "hsdp2x2-clip-llama", "hsdp4x1-llama"} <= names, names
    assert "hsdp2x2-compile-llama" in names and all(c["comm_checked"] for c in doc["cases"])
    assert "hsdp2x2-llama-sharded_state_dict" in names and doc["ok"]
    bad = _run(
        ["--backend", "broken_backends:SkipsReplicaAllReduceBackend", "--world-size", "4"]
        + ["--cases", "hsdp2x2-mlp,hsdp2x2-llama", "--report", str(tmp_path / "bad"), "--no-plots"]
    )
    assert bad.returncode == 1 and _summary(bad, "FAIL", "0/2"), bad.stdout[-3000:] + bad.stderr[-3000:]


@pytest.mark.multiprocess
def test_tp_on_four_ranks_matches_and_its_evidence_is_observed(tmp_path):
    """Tensor parallelism under FSDP on 4 gloo ranks (dp_shard 2 x tp 2, and 2 replicas x tp 2):
    every tp case matches the single-device run, its collectives are the predicted ones (FSDP's on
    the data-parallel ranks, TP's on the tp pairs) and each weight is split as the plan says; the
    compiled case too, on a torch release that certifies it. The 2-rank tp cases run in the whole
    matrix above."""
    out = _run(
        ["--backend", "fsdp2", "--world-size", "4", "--cases", "*tp2-*", "--report", str(tmp_path), "--no-plots"]
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "report.json").read_text())
    rows = {c["case"]: c for c in doc["cases"]}
    assert {"dp2-tp2-llama", "dp2-tp2-qwen2", "dp2-tp2-llama-ac1", "hsdp2x1-tp2-llama"} <= set(rows)
    assert {"dp2-tp2-llama-sharded_state_dict", "dp2-tp2-qwen2-sharded_state_dict", "dp2-tp2-clip-llama"} <= set(rows)
    assert {"dp2-tp2-llama-mp-bf16", "dp2-tp2-qwen2-mp-bf16", "dp2-tp2-llama-bf16_weights"} <= set(rows)
    assert doc["ok"] and all(c["comm_checked"] for c in doc["cases"])
    assert "mixed_precision" in rows["dp2-tp2-llama-mp-bf16"]["observed"]["compute dtype"]
    for name in ("dp2-tp2-llama", "dp2-tp2-qwen2"):
        comm = rows[name]["comm"]
        # FSDP's gathers and reduce-scatters over the dp pair; over the tp pair, per decoder layer the
        # attention's and the MLP's outputs summed in forward and their inputs' gradients in backward
        # (q, k, v share one), the embedding's output and the head's input gradient: 2 x 4 + 2
        assert comm["reduce_scatter"]["count"] and comm["all_reduce"]["count"] == 10, (name, comm)
        split = rows[name]["placement"]["tp_split"]
        assert split["model.layers.0.self_attn.o_proj.weight"] == 1 and split["model.embed_tokens.weight"] == 0, split
    for key in ("tp_size", "tp_plan"):
        assert set(doc["evidence"][key]["observed_by"]) == {"communication", "placement"}, doc["evidence"][key]
    # compiled TP, where this torch release certifies it: the units compile in the first step and
    # never again; TP's collectives run inside the compiled graphs, so placement, not communication,
    # observes tp_size there
    from shardcore_fsdp2.tensor_parallel import compiled_tp_certified

    certified = compiled_tp_certified()
    assert ("dp2-tp2-compile-llama" in rows) is certified, sorted(rows)
    if certified:
        compiled = rows["dp2-tp2-compile-llama"]
        assert compiled["compiled_graphs"][0] and not any(compiled["compiled_graphs"][1:]), compiled
        assert "tp_size" in compiled["observed"]["placement"], compiled["observed"]
        assert "tp_size" not in compiled["observed"].get("communication", []), compiled["observed"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backend, cases, gathers, placement",
    [
        # runs every rank as one FSDP group: the numbers are right, nothing is split
        (
            "IgnoresTensorParallelBackend",
            "tp2-llama,tp2-qwen2",
            "all_gather calls, expected 1",
            " is not split over the tp mesh dim; the plan (tp_size 2) has it split along dim 0",
        ),
        # gathers where it should sum: the numbers are right, the other dim of each rowwise weight is split
        (
            "SplitsRowwiseColwiseBackend",
            "tp2-llama,tp2-qwen2",
            "all_gather calls, expected 1",
            "'s model.layers.0.mlp.down_proj.weight is split along dim 0 over the tp mesh dim; the plan (tp_size 2) has it split along dim 1",
        ),
        # accepts tp_plan and splits by the model's own plan: the numbers are right, other weights split
        (
            "IgnoresTpPlanBackend",
            "tp2-llama-plan",
            "1 all_gather calls, expected 3",
            "'s model.embed_tokens.weight is split along dim 0 over the tp mesh dim; the plan (tp_size 2) has it not split",
        ),
    ],
)
def test_suite_catches_a_backend_that_gets_tensor_parallelism_wrong(backend, cases, gathers, placement):
    from shardcore_conformance import run_suite, select

    chosen = select(fsdp2_matrix(), cases)
    result = run_suite(chosen, f"broken_backends:{backend}", world_size=2, plots=False)
    assert not result.ok and len(result.verdicts) == len(chosen) == len(cases.split(","))
    for v in result.verdicts:
        comm, split = v.reasons
        assert comm.startswith("communication differs at step 0 on rank 0: ") and gathers in comm
        assert split.startswith("tensor parallelism: rank 0") and placement in split, split
        assert v.max_param_diff <= v.tolerance["param_atol"] and v.max_loss_diff <= v.tolerance["loss_atol"], v.case


@pytest.mark.multiprocess
def test_xfails_report_known_gaps_apart_and_only_unexpected_failures_fail(tmp_path):
    """A vendor's --xfails file: the broken backend's failing clipping case is an expected failure (exit 0,
    listed apart), a passing case it names is an unexpected pass, an entry matching nothing warns;
    a failing case it does not name still fails the run."""
    xf = tmp_path / "xfails.txt"
    xf.write_text("# known gaps\nclip-*  local norm VENDOR-1\nuneven-mlp  stale entry\nnothing-*  matches no case\n")
    cases = "clip-llama,uneven-mlp"
    backend = "broken_backends:LocalNormClippingBackend"
    out = _run(
        ["--backend", backend, "--cases", cases, "--xfails", str(xf), "--report", str(tmp_path / "r"), "--no-plots"]
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("XFAIL clip-llama (expected: local norm VENDOR-1): ")]
    assert "clipping norm differs at step 0" in line, line
    assert "XPASS uneven-mlp" in out.stdout and _summary(out, "PASS", "1/2", ", 1 expected failures")
    assert "line 4: 'nothing-*' matches no case of this run" in out.stderr
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["ok"] and doc["failed"] == 0
    assert [x["case"] for x in doc["expected_failures"]] == ["clip-llama"]
    assert [x["case"] for x in doc["unexpected_passes"]] == ["uneven-mlp"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Expected failures" in md and "| clip-llama | fp32 | expected fail |" in md

    xf.write_text("uneven-mlp  a gap elsewhere\n")
    out = _run(
        ["--backend", backend, "--cases", cases, "--xfails", str(xf), "--report", str(tmp_path / "r2"), "--no-plots"]
    )
    assert out.returncode == 1, out.stdout[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("FAIL clip-llama: ")]
    assert "clipping norm differs at step 0" in line, line


@pytest.mark.multiprocess
def test_cli_case_timeout_kills_and_fails(tmp_path):
    """A case that stalls (its ranks sleep an hour in the first step) is killed at its deadline and
    fails; the reference, which does not stall, is unaffected."""
    out = _run(
        [
            "--backend",
            "broken_backends:StallsBackend",
            "--cases",
            "mlp-transformer-reshard1-ac0",
            "--case-timeout",
            "5",
            "--report",
            str(tmp_path),
            "--no-plots",
        ],
        timeout=120,
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "did not finish within 5s (timeout)" in out.stdout and _summary(out, "FAIL", "0/1")


@pytest.fixture(scope="module")
def vendor_site(tmp_path_factory):
    """examples/vendor_backend pip-installed into a temporary directory (put on PYTHONPATH), so its
    entry point is found without touching the shared environment. From a copy, so that the build
    leaves nothing in the source tree."""
    tmp = tmp_path_factory.mktemp("vendor")
    src, site = tmp / "src", tmp / "site"
    shutil.copytree(
        ROOT / "examples" / "vendor_backend", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert (site / "shardcore_replicate_example").is_dir()
    return site


@pytest.mark.multiprocess
def test_vendor_backend_is_found_by_name_and_passes(vendor_site, tmp_path):
    env = {"PYTHONPATH": str(vendor_site)}
    listed = _run(["--backend", "replicate-example", "--list"], env_extra=env, timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    # it declares only `timeout`: no wrap/reshard/offload/precision dimensions
    assert len(names) < len(fsdp2_matrix()) and "mlp-transformer" in names and "mlp-timeout" in names
    assert "clip-llama" in names  # it declares clipping
    assert not any("nowrap" in n or "cpu_offload" in n or "bf16" in n for n in names)
    bf16 = _run(["--backend", "replicate-example", "--dtype", "bf16", "--list"], env_extra=env, timeout=120)
    assert bf16.returncode == 2 and "no way to compute in bf16" in bf16.stderr

    out = _run(
        [
            "--backend",
            "replicate-example",
            "--world-size",
            "2",
            "--cases",
            "gpt2-transformer,frozen-llama,buffers-mlp,grad_accum-mlp,clip-llama",
            "--report",
            str(tmp_path),
            "--no-plots",
        ],
        env_extra=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _summary(out, "PASS", "5/5")
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["supported_keys"] == ["timeout"]
    assert all(r["checkpoint_param_diff"] == 0.0 for r in doc["cases"])


@pytest.mark.cuda
@pytest.mark.multiprocess
def test_fsdp2_conformance_on_cuda_in_bf16(tmp_path):
    """The suite on a CUDA device (NCCL) at world size 1, every case in bf16: what `run` on a GPU
    machine checks."""
    out = _run(
        ["--backend", "fsdp2", "--device-type", "cuda", "--world-size", "1", "--dtype", "bf16", "--no-plots", "-q"]
        + ["--report", str(tmp_path)],
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text())["ok"]
