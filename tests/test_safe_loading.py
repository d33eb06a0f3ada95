"""Reading a checkpoint never runs code from it: DCP metadata is unpickled with an allow-list, and
DCP's non-tensor entries are read with torch.load(weights_only=True)."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import harness

os.environ.setdefault("USE_TORCH_XLA", "0")

from shardcore import CheckpointError, safe_dcp  # noqa: E402

WORKER = harness.worker("safe_load")


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_real_dcp_metadata_reads_as_pickle_does(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "name": "g"}], "step": torch.tensor(3)},
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    got = safe_dcp.reader(str(tmp_path)).read_metadata()
    with open(tmp_path / ".metadata", "rb") as f:
        want = pickle.load(f)
    assert got.state_dict_metadata == want.state_dict_metadata
    assert got.storage_data == want.storage_data
    # and DCP loads through the safe reader and planner
    out = {
        "model": {"w": torch.zeros(3, 2), "b": torch.ones(2, dtype=torch.bfloat16)},
        "optimizer": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "name": ""}], "step": torch.tensor(0)},
    }
    dcp.load(out, storage_reader=safe_dcp.reader(str(tmp_path)), planner=safe_dcp.planner(), no_dist=True)
    assert torch.equal(out["model"]["w"], state["model"]["w"]) and out["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99) and int(out["optimizer"]["step"]) == 3


def test_metadata_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match=r"posix\.system is not part of torch\.distributed\.checkpoint metadata"):
        safe_dcp.reader(str(tmp_path)).read_metadata()
    assert not marker.exists()


def test_bytes_entry_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    buf.seek(0)
    with pytest.raises(CheckpointError, match="non-tensor entry of the checkpoint was refused"):
        safe_dcp.load_bytes(buf)
    assert not marker.exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["metadata", "bytes"])
def test_shardcore_load_of_a_malicious_sharded_checkpoint(tmp_path, kind):
    """Through shardcore.load on a sharded FSDP2 model: refused with CheckpointError, and the
    command in the checkpoint never runs (torch's own reader and planner would run it)."""
    marker = tmp_path / "ran"
    out = harness.python(WORKER, kind, str(tmp_path / "ckpt"), str(marker), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
    assert error and error["type"] == "CheckpointError", error
    assert "posix.system" in error["message"] or "non-tensor entry" in error["message"], error
    assert not marker.exists(), "the checkpoint ran its command"
