"""A checkpoint's files are read from inside its directory only: names in the safetensors index, in
DCP's metadata and in XLA FSDP's shard index, and symlinks, that lead elsewhere are refused before
anything is read. ``save`` never writes through a symlink either."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

os.environ.setdefault("USE_TORCH_XLA", "0")

import shardcore  # noqa: E402
from shardcore import CheckpointError, safe_dcp  # noqa: E402
from shardcore.checkpoint import WEIGHTS, WEIGHTS_INDEX  # noqa: E402
from shardcore_conformance.models import MLP  # noqa: E402

from ckpt_helpers import assert_same_state, llama, state_of  # noqa: E402


def _outside(tmp_path: Path) -> Path:
    """A safetensors file beside the checkpoint, with the MLP's keys and every value 7.0."""
    from safetensors.torch import save_file

    secret = tmp_path / "outside" / "secret.safetensors"
    secret.parent.mkdir()
    save_file({k: torch.full_like(v, 7.0) for k, v in MLP().state_dict().items()}, str(secret))
    return secret


def _indexed(tmp_path: Path, name: str) -> Path:
    """A save_pretrained-style directory whose index maps every weight to ``name``."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weight_map = {k: name for k in MLP().state_dict()}
    (ckpt / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ckpt


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_an_index_entry_outside_the_directory_is_refused(tmp_path, how):
    secret = _outside(tmp_path)
    name = "../outside/secret.safetensors" if how == "dotdot" else str(secret)
    ckpt = _indexed(tmp_path, name)
    model = MLP()
    before = state_of(model)
    with pytest.raises(CheckpointError, match=rf"weight_map in .* names {name!r}, (a path with '\.\.'|an absolute)"):
        shardcore.load(model, ckpt)
    assert_same_state(state_of(model), before)  # nothing of the 7.0s arrived


def test_a_symlink_out_of_the_directory_is_refused(tmp_path):
    secret = _outside(tmp_path)
    # the index names a file inside, which is a symlink to the outside file
    ckpt = _indexed(tmp_path, "shard-1.safetensors")
    (ckpt / "shard-1.safetensors").symlink_to(secret)
    with pytest.raises(CheckpointError, match=r"names 'shard-1.safetensors', a symlink that leads to .*secret"):
        shardcore.load(MLP(), ckpt)
    # model.safetensors itself a symlink
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / WEIGHTS).symlink_to(secret)
    with pytest.raises(CheckpointError, match=r"the weights file in .* names 'model.safetensors', a symlink"):
        shardcore.load(MLP(), plain)


def test_names_that_stay_inside_still_load(tmp_path):
    model = MLP()
    ckpt = shardcore.save(model, tmp_path / "good")
    # an index with a subdirectory and a '..' that comes back inside, and a symlink within
    (ckpt / "sub").mkdir()
    (ckpt / WEIGHTS).rename(ckpt / "sub" / "w.safetensors")
    (ckpt / "link.safetensors").symlink_to(ckpt / "sub" / "w.safetensors")
    weight_map = {
        k: ("sub/../link.safetensors" if i % 2 else "sub/w.safetensors") for i, k in enumerate(model.state_dict())
    }
    (ckpt / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    other = MLP()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    shardcore.load(other, ckpt)
    assert_same_state(state_of(other), state_of(model))


def test_the_hugging_face_cache_layout_is_read(tmp_path):
    """The hub cache's snapshots are symlinks into the repository's own blobs: that is not an escape."""
    model = MLP()
    saved = shardcore.save(model, tmp_path / "saved")
    repo = tmp_path / "hub" / "models--org--mlp"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    blob = repo / "blobs" / "9f86d081884c7d65"
    blob.write_bytes((saved / WEIGHTS).read_bytes())
    (snapshot / WEIGHTS).symlink_to(os.path.relpath(blob, snapshot))
    other = MLP()
    shardcore.load(other, snapshot)
    assert_same_state(state_of(other), state_of(model))
    # a blob of another repository is outside
    stranger = tmp_path / "hub" / "models--other--x" / "blobs"
    stranger.mkdir(parents=True)
    (stranger / "b").write_bytes(blob.read_bytes())
    (snapshot / WEIGHTS).unlink()
    (snapshot / WEIGHTS).symlink_to(stranger / "b")
    with pytest.raises(CheckpointError, match="a symlink that leads to"):
        shardcore.load(MLP(), snapshot)


def test_optimizer_state_and_manifest_symlinks_out_are_refused(tmp_path):
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 13)).sum().backward()
    opt.step()
    ckpt = shardcore.save(model, tmp_path / "ckpt", opt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("optimizer.json", "shardcore.json"):
        (ckpt / name).rename(elsewhere / name)
        (ckpt / name).symlink_to(elsewhere / name)
        fresh = MLP()
        with pytest.raises(CheckpointError, match=rf"names {name!r}, a symlink that leads to"):
            shardcore.load(fresh, ckpt, torch.optim.AdamW(fresh.parameters()))
        (ckpt / name).unlink()
        (elsewhere / name).rename(ckpt / name)
    fresh = MLP()
    shardcore.load(fresh, ckpt, torch.optim.AdamW(fresh.parameters()))  # and back in place, it loads


def _dcp(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    dcp.save({"model.w": torch.ones(3, 2)}, checkpoint_id=str(path), no_dist=True)
    return path


def test_a_dcp_storage_path_outside_the_directory_is_refused(tmp_path):
    path = _dcp(tmp_path)
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    (tmp_path / "evil.distcp").write_bytes(next(path.glob("*.distcp")).read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../evil.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"storage_data in .* names '\.\./evil\.distcp', a path with '\.\.'"):
        safe_dcp.reader(str(path)).read_metadata()


def test_dcp_files_that_are_symlinks_out_are_refused(tmp_path):
    path = _dcp(tmp_path)
    data = next(path.glob("*.distcp"))
    moved = tmp_path / data.name
    data.rename(moved)
    data.symlink_to(moved)
    with pytest.raises(CheckpointError, match="storage_data in .* a symlink that leads to"):
        safe_dcp.reader(str(path)).read_metadata()
    data.unlink()
    moved.rename(data)
    (path / ".metadata").rename(tmp_path / "md")
    (path / ".metadata").symlink_to(tmp_path / "md")
    with pytest.raises(CheckpointError, match=r"the DCP metadata in .* names '\.metadata', a symlink"):
        safe_dcp.reader(str(path)).read_metadata()


def test_xla_fsdp_shard_files_that_are_symlinks_out_are_refused(tmp_path):
    """XLA FSDP's shards.json names its rank files by count; a rank file that is a symlink to another
    checkpoint's is refused."""
    sharded = pytest.importorskip("shardcore_xla.sharded", reason="needs the shardcore-xla package")
    from safetensors.torch import save_file

    path = tmp_path / "xla"
    path.mkdir()
    index = {"format": sharded.FORMAT, "world_size": 1, "pieces": {"w": [["w", [2]]]}, "keys": {"w": [2]}}
    index |= {"optimizer": False, "optimizer_scalars": {}}
    (path / sharded.INDEX).write_text(json.dumps(index))
    other = tmp_path / "other.safetensors"
    save_file({"model.w": torch.ones(2)}, str(other))
    (path / "rank-00000-of-00001.safetensors").symlink_to(other)
    with pytest.raises(CheckpointError, match=r"names 'rank-00000-of-00001\.safetensors', a symlink"):
        sharded.read_fsdp(str(path))
    (path / "rank-00000-of-00001.safetensors").unlink()
    save_file({"model.w": torch.ones(2)}, str(path / "rank-00000-of-00001.safetensors"))
    assert torch.equal(sharded.read_fsdp(str(path))[0]["w"], torch.ones(2))


def test_from_pretrained_refuses_an_index_that_leads_outside(tmp_path):
    """Transformers' own loader joins the index's names to the directory as they come;
    shardcore.from_pretrained checks them first."""
    from transformers import AutoModelForCausalLM

    model = llama()
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    index = json.loads((tmp_path / "hf" / WEIGHTS_INDEX).read_text())
    first = next(iter(index["weight_map"]))
    (tmp_path / "outside").mkdir()
    shard = index["weight_map"][first]
    (tmp_path / "hf" / shard).rename(tmp_path / "outside" / shard)
    for k, v in index["weight_map"].items():
        if v == shard:
            index["weight_map"][k] = f"../outside/{shard}"
    (tmp_path / "hf" / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"names '\.\./outside/{shard}', a path with '\.\.'"):
        shardcore.from_pretrained(AutoModelForCausalLM, tmp_path / "hf", None)


def test_save_never_writes_through_a_symlink(tmp_path):
    """Saving over a checkpoint that holds a symlink to a file elsewhere replaces the link, and leaves
    the file it pointed to as it was (a save replaces directories, it never opens old files)."""
    model = MLP()
    ckpt = shardcore.save(model, tmp_path / "ckpt")
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    (ckpt / WEIGHTS).unlink()
    (ckpt / WEIGHTS).symlink_to(victim)
    shardcore.save(model, ckpt)
    assert victim.read_bytes() == b"precious" and (victim.stat().st_mode & 0o777) == 0o600
    assert not (ckpt / WEIGHTS).is_symlink()
    # and the destination itself a symlink to a directory elsewhere is refused, not followed
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(CheckpointError, match="is a symlink .* never writes through a link"):
        shardcore.save(model, tmp_path / "link")
    assert list(target.iterdir()) == []
