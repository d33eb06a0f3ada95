"""Atomic saves: a save killed (SIGKILL, every rank) before its commit, or failing, or interrupted
between its renames, leaves the previous checkpoint loadable; a save never overwrites what is not a
checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

import shardcore
import shardcore.checkpoint as ckpt
from shardcore_conformance.models import MLP

import harness
from ckpt_helpers import DEADLINE, assert_same_state, command, llama, load_pt, state_of, torchrun


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_killed_save_leaves_previous_checkpoint(tmp_path, kind):
    """SIGKILL every process of a 2-rank run while its second save is on disk but not committed."""
    marker = tmp_path / "saving"
    proc = subprocess.Popen(
        command(2, "ckpt_kill", str(tmp_path), kind),
        env=harness.clean_env(SHARDCORE_TEST_CKPT_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + DEADLINE
        while not marker.exists():
            if proc.poll() is not None or time.time() > deadline:
                out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
                pytest.fail(f"the worker never reached the second save (rc {proc.poll()}):\n{out[-3000:]}")
            time.sleep(0.2)
    finally:
        harness.kill_group(proc)
    name = "killed_full" if kind == "FULL_STATE_DICT" else "killed_sharded"
    target = tmp_path / name
    partial = Path(marker.read_text())
    assert partial.parent == tmp_path and partial.name.startswith(f".{name}.shardcore-tmp-")
    assert any(partial.iterdir()), "the killed save had written nothing; the test would prove nothing"
    expected = load_pt(tmp_path / f"{name}.expected.pt")
    manifest = json.loads((target / "shardcore.json").read_text())
    assert manifest["state_dict_type"] == kind
    if kind == "FULL_STATE_DICT":
        model = llama(seed=1)
        shardcore.load(model, target)
        assert_same_state(state_of(model), expected)
    else:  # a sharded checkpoint loads only in a sharded run: one rank, new processes
        torchrun(1, "ckpt_reload", str(target), str(tmp_path / "killed_sharded.loaded.pt"))
        assert_same_state(load_pt(tmp_path / "killed_sharded.loaded.pt")["state"], expected)
    # the next save succeeds and removes the leftovers of the killed one
    if kind == "FULL_STATE_DICT":
        shardcore.save(model, target)
        assert not partial.exists()


def test_save_never_overwrites_what_is_not_a_checkpoint(tmp_path):
    model = MLP()
    f = tmp_path / "file"
    f.write_text("keep me")
    with pytest.raises(shardcore.CheckpointError, match="exists and is not a directory"):
        shardcore.save(model, f)
    assert f.read_text() == "keep me"
    d = tmp_path / "dir"
    d.mkdir()
    (d / "notes.txt").write_text("keep me too")
    with pytest.raises(shardcore.CheckpointError, match="not a shardcore checkpoint"):
        shardcore.save(model, d)
    assert [p.name for p in d.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]  # no temporary left behind


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    shardcore.save(model, tmp_path / "c")
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.manifest, "write_manifest", disk_full)
    with pytest.raises(OSError, match="No space left"):
        shardcore.save(model, tmp_path / "c")
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    monkeypatch.undo()
    shardcore.save(model, tmp_path / "c")  # a good save replaces it
    fresh = MLP()
    shardcore.load(fresh, tmp_path / "c")
    assert_same_state(state_of(fresh), state_of(model))


def test_interrupted_swap_falls_back_to_the_old_copy(tmp_path, monkeypatch):
    """Without an atomic exchange the old checkpoint is moved aside first; if the process dies
    between the two renames, load() finds the old copy."""
    torch.manual_seed(0)
    model = MLP()
    shardcore.save(model, tmp_path / "c")
    monkeypatch.setattr(ckpt.atomic, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def die_on_second(src, dst):
        if Path(src).name.startswith(".c.shardcore-tmp-"):
            raise KeyboardInterrupt  # stands for the process dying between the renames
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", die_on_second)
    with pytest.raises(KeyboardInterrupt):
        shardcore.save(MLP(), tmp_path / "c")
    monkeypatch.undo()
    assert not (tmp_path / "c").exists() and (tmp_path / ".c.shardcore-old").is_dir()
    fresh = MLP()
    shardcore.load(fresh, tmp_path / "c")
    assert_same_state(state_of(fresh), state_of(model))
