"""Checkpoint errors in one process: what is not a checkpoint, a checkpoint of another model, a
SHARDED checkpoint outside a sharded run, and a bad state_dict_type."""

from __future__ import annotations

import pytest
import torch

import shardcore
from shardcore_conformance.models import MLP

from ckpt_helpers import llama


def test_not_a_checkpoint(tmp_path):
    model = MLP()
    with pytest.raises(shardcore.CheckpointError, match="does not exist"):
        shardcore.load(model, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(shardcore.CheckpointError, match=r"is not a checkpoint.*no shardcore.json"):
        shardcore.load(model, tmp_path / "empty")
    (tmp_path / "f.txt").write_text("hi")
    with pytest.raises(shardcore.CheckpointError, match="not a checkpoint"):
        shardcore.load(model, tmp_path / "f.txt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(shardcore.CheckpointError, match="not a readable safetensors"):
        shardcore.load(model, tmp_path / "bad.safetensors")


def test_checkpoint_of_another_model(tmp_path):
    torch.manual_seed(0)
    shardcore.save(MLP(d_in=13, hidden=33), tmp_path / "a")
    with pytest.raises(
        shardcore.CheckpointError,
        match=r"another model.*shape.*blocks\.0\.fc\.weight: checkpoint \(33, 13\), model \(40, 13\)",
    ):
        shardcore.load(MLP(hidden=40), tmp_path / "a")
    with pytest.raises(shardcore.CheckpointError, match=r"another model: \d+ missing.*\d+ unexpected"):
        shardcore.load(llama(), tmp_path / "a")
    with pytest.raises(shardcore.CheckpointError, match="holds no optimizer state"):
        m = MLP()
        shardcore.load(m, tmp_path / "a", torch.optim.SGD(m.parameters(), lr=0.1))


def test_sharded_checkpoint_outside_a_sharded_run(tmp_path):
    model = MLP()
    with pytest.raises(shardcore.CheckpointError, match="SHARDED_STATE_DICT needs a model returned by shardcore.shard"):
        shardcore.save(model, tmp_path / "s", state_dict_type="SHARDED_STATE_DICT")
    assert not (tmp_path / "s").exists()
    # a DCP directory (as a sharded run writes it) refuses an unsharded model
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(
        shardcore.CheckpointError,
        match=r"SHARDED_STATE_DICT checkpoint.*loads only into a model returned by shardcore.shard\(\).*FULL_STATE_DICT",
    ):
        shardcore.load(model, tmp_path / "dcp")


def test_bad_state_dict_type(tmp_path):
    with pytest.raises(shardcore.ShardConfigError, match="state_dict_type"):
        shardcore.save(MLP(), tmp_path / "x", state_dict_type="LOCAL_STATE_DICT")


@pytest.mark.parametrize("name", ["shardcore.json", "optimizer.json", "model.safetensors.index.json"])
def test_json_nested_past_the_parsers_recursion_limit_is_a_checkpoint_error(tmp_path, name):
    """Every JSON file a checkpoint holds goes through one reader: 200,000 nested arrays (a
    RecursionError in json.loads) is a CheckpointError naming the file, like any other bad JSON."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 13)).sum().backward()
    opt.step()
    shardcore.save(model, tmp_path / "c", opt)
    if name == "model.safetensors.index.json":
        (tmp_path / "c" / "model.safetensors").rename(tmp_path / "c" / "model-00001-of-00001.safetensors")
    (tmp_path / "c" / name).write_text("[" * 200_000)
    with pytest.raises(shardcore.CheckpointError, match=rf"{name}.*is not readable JSON \(maximum recursion depth"):
        shardcore.load(MLP(), tmp_path / "c", torch.optim.AdamW(MLP().parameters()))
