"""FSDP2 for real: 2 gloo ranks in separate processes against the single-device reference."""

import json
import time

import pytest

from shardcore_conformance import Case, fsdp2_matrix, run_suite

import harness
from harness import BIN, ROOT

pytestmark = pytest.mark.multiprocess


def test_fsdp2_matches_single_device_on_every_case(tmp_path):
    cases = fsdp2_matrix()
    result = run_suite(cases, "fsdp2", world_size=2, case_timeout=180, report_dir=tmp_path)
    failures = "\n".join(f"{v.case}: {v.reasons}" for v in result.failures())
    assert result.ok, failures
    assert len(result.verdicts) == len(cases) >= 20
    # the comparison compared something: every case trained and moved
    for name, r in result.sharded.items():
        assert len(r["losses"]) == 5 and r["losses"][0] != r["losses"][-1], name
    assert (tmp_path / "report.json").exists() and "PASS" in (tmp_path / "report.md").read_text()


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
    out = harness.torchrun(2, harness.worker("efficient_mismatch"), mode, str(tmp_path), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1], out.stdout
    for r in rows:
        assert r["error"]["type"] == "ShardConfigError" and r["error"]["key"] == "cpu_ram_efficient_loading", r
        assert fragment in r["error"]["message"], r
        assert r["applied"] is False, r
