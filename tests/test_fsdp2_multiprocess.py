"""FSDP2 for real: 2 gloo ranks in separate processes against the single-device reference."""

import json
import time

import pytest
import torch

from shardcore_conformance import Case, run_suite

import harness
from harness import BIN, ROOT

pytestmark = pytest.mark.multiprocess


# The whole matrix runs once, through the command: tests/test_conformance_cli.py.
# The broken backends are caught through the CLI in tests/test_conformance_suite.py.


def test_failing_case_is_reported_and_the_rest_still_run():
    cases = [
        Case("mlp-bad-class", "mlp", {"transformer_layer_cls_to_wrap": ["NoSuchBlock"]}),
        Case("mlp-ok", "mlp", {}),
    ]
    result = run_suite(cases, "fsdp2", world_size=2, case_timeout=180)
    bad, good = result.verdicts
    assert not bad.ok and "NoSuchBlock" in bad.reasons[0]
    assert good.ok, good.reasons


def test_accelerate_launch(tmp_path):
    """One accelerate FSDP2 config file drives both `accelerate launch` and shardcore.shard."""
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\nnum_machines: 1\n"
        "machine_rank: 0\nmain_process_port: 29533\nmixed_precision: 'no'\nuse_cpu: false\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  fsdp_reshard_after_forward: false\n"
    )
    out = harness.run(
        [
            BIN / "accelerate",
            "launch",
            "--config_file",
            cfg,
            ROOT / "examples" / "demo.py",
            "--steps",
            "3",
            "--config",
            cfg,
        ],
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "fsdp2 on 2 rank(s) (cpu)" in out.stdout


def test_missing_peer_fails_within_timeout():
    """Rank 0 of 2 with no rank 1: a clear error after the config's timeout, not a hang."""
    t0 = time.time()
    env = harness.clean_env(
        RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(harness.free_port())
    )
    out = harness.python(harness.worker("shard_mlp"), "5", env=env, timeout=120)
    assert "CLEAR ERROR:" in out.stdout, out.stderr[-2000:]
    assert "rank 0 of 2" in out.stdout and "timeout" in out.stdout
    assert time.time() - t0 < 90


def test_incomplete_launcher_environment():
    out = harness.python(harness.worker("shard_mlp"), env=harness.clean_env(RANK="0", WORLD_SIZE="2"), timeout=120)
    assert out.returncode != 0
    assert "DistributedSetupError" in out.stderr and "MASTER_ADDR" in out.stderr


@pytest.mark.parametrize(
    "mode, fragment",
    [("differ", "rank 1's model differs from rank 0's"), ("meta", "rank 0's model has tensors on the meta device")],
)
def test_efficient_loading_refuses_a_model_rank0_cannot_fill_before_sharding(tmp_path, mode, fragment):
    """Validated once, before apply: every rank gets the same ShardConfigError, no rank hangs in a
    collective of apply, and no rank's model is touched."""
    out = harness.ranks(2, harness.worker("efficient_mismatch"), mode, str(tmp_path), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1], out.stdout
    for r in rows:
        assert r["error"]["type"] == "ShardConfigError" and r["error"]["key"] == "cpu_ram_efficient_loading", r
        assert fragment in r["error"]["message"], r
        assert r["applied"] is False, r


def test_workers_forked_from_the_preloading_server_train_as_fresh_interpreters_do():
    """CPU workers are forks of a server that imported torch, Transformers and the suite once; a
    launch whose environment changes what an import or a kernel library reads (the CPU ISA caps,
    Transformers' XLA mode), XLA, and CUDA machines get fresh interpreters. Both kinds of worker
    train a case to the same bits."""
    from shardcore_conformance.launch import run_cases, worker_start_method

    if torch.cuda.is_available():
        assert worker_start_method(None, False, {}) == "spawn"
        pytest.skip("needs a machine without CUDA for the fork server; this one has a GPU")
    assert worker_start_method(None, False, {"SHARDCORE_CONFORMANCE_SCRATCH": "/tmp/x"}) == "forkserver"
    assert worker_start_method("fsdp2", False, {"CUDA_VISIBLE_DEVICES": ""}) == "forkserver"
    # what run_suite adds for an XLA run's reference and for a CPU run: read when the run starts
    xla_reference = {"SHARDCORE_CONFORMANCE_DEVICE": "xla", "SHARDCORE_CONFORMANCE_SCRATCH": "/tmp/x"}
    assert worker_start_method(None, False, xla_reference) == "forkserver"
    assert worker_start_method("fsdp2", False, {"SHARDCORE_DEVICE": "cpu", "SHARDCORE_CONFORMANCE_DEVICE": "cpu"}) == (
        "forkserver"
    )
    for env in ({"ATEN_CPU_CAPABILITY": "default"}, {"ONEDNN_MAX_CPU_ISA": "SSE41"}, {"USE_TORCH_XLA": "1"}):
        assert worker_start_method("fsdp2", False, env) == "spawn", env
    assert worker_start_method("xla", False, {}) == "spawn"
    assert worker_start_method("broken_xla_backends:X", False, {}) == "spawn"
    assert worker_start_method("fsdp2", True, {}) == "spawn"

    cases = [Case("llama", "llama", {}), Case("gpt2-tied", "gpt2", {})]
    forked = run_cases(cases, None, 1, 180)
    fresh = run_cases(cases, None, 1, 180, start_method="spawn")
    for c in cases:
        assert forked[c.name]["losses"] == fresh[c.name]["losses"], c.name
        for k, v in fresh[c.name]["params"].items():
            assert torch.equal(forked[c.name]["params"][k], v), (c.name, k)
