"""Checkpoints: FULL (safetensors) and SHARDED (DCP), exact resume, resharding, atomic saves,
cpu_ram_efficient_loading, and the errors for bad input.

Multi-process checks run ``tests/workers/ckpt.py`` under ``torchrun`` in fresh processes (a new
process group each time), with a deadline; the checks that need no process group run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

import harness

os.environ.setdefault("USE_TORCH_XLA", "0")

import shardcore  # noqa: E402
import shardcore.checkpoint as ckpt  # noqa: E402
from shardcore_conformance.models import MLP, tiny_llama_config  # noqa: E402

WORKER = harness.worker("ckpt")
DEADLINE = 240.0


def _command(nproc: int, *args: str) -> list[str]:
    return [str(harness.BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), str(WORKER), *args]


def torchrun(nproc: int, *args: str, timeout: float = DEADLINE) -> None:
    """Run the worker on ``nproc`` ranks; a failure or a hang past ``timeout`` fails the test."""
    proc = harness.run(_command(nproc, *args), timeout=timeout, merge=True)
    if proc.returncode != 0:
        text = proc.stdout
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        pytest.fail(
            f"workers/ckpt.py {' '.join(args)} on {nproc} ranks failed (rc {proc.returncode}):\n"
            + "\n".join(errors[-15:])
            + "\n"
            + text[-3000:]
        )


def llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True, **overrides))


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {float((got[k] - want[k]).abs().max()):.3g}"


def load_pt(path: Path):
    return torch.load(path, weights_only=True)


# ------------------------------------------------------------------------------------ multi-process runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Real runs, each in new processes: 2 ranks train 3 steps, save FULL + SHARDED, train 3 more
    (and check errors); then 1 rank loads the 2-rank SHARDED checkpoint and saves SHARDED again."""
    d = tmp_path_factory.mktemp("ckpt")
    plain = llama(seed=7)
    shardcore.save(plain, d / "single")  # an unsharded model saves FULL with the same code
    plain.save_pretrained(d / "hf_single")
    torch.save(state_of(plain), d / "single.expected.pt")
    torchrun(2, "train_save", str(d))
    torchrun(1, "world1", str(d))
    return d


@pytest.fixture(scope="module")
def resumed(runs) -> Path:
    """2 new ranks resume from both formats, load the 1-rank checkpoint and single-device ones."""
    torchrun(2, "resume", str(runs))
    return runs


@pytest.fixture(scope="module")
def efficient(runs) -> Path:
    """2 new ranks: from_pretrained with cpu_ram_efficient_loading."""
    torchrun(2, "efficient", str(runs))
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("fmt", ["full3", "sharded3"])
def test_resume_is_bit_identical(resumed, fmt):
    """6 steps straight == 3 steps, save, new process group, load, 3 steps (losses and params)."""
    straight = load_pt(resumed / "straight.pt")
    got = load_pt(resumed / "resume.pt")[fmt]
    assert got["losses"] == straight["losses"][3:]
    assert_same_state(got["state"], straight["state"])


@pytest.mark.multiprocess
def test_hsdp_checkpoints_resume_into_other_layouts(tmp_path):
    """4 ranks, HSDP 2x2 -> 1x4 -> 4x1, both formats: every load gives back exactly the parameters
    and AdamW state the previous layout saved, and training goes on as a straight run would."""
    torchrun(4, "hsdp_chain", str(tmp_path), timeout=420)
    got = load_pt(tmp_path / "hsdp_chain.pt")
    straight = got["straight"]
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        runs = got[kind]
        assert [r["layout"] for r in runs] == [[2, 2], [1, 4], [4, 1]]
        for before, after in zip(runs, runs[1:]):
            assert_same_state(after["loaded"]["params"], before["saved"]["params"])
            assert_same_state(after["loaded"]["optim"], before["saved"]["optim"])
        losses = [x for r in runs for x in r["losses"]]
        assert len(losses) == len(straight) == 6
        for a, b in zip(losses, straight):  # other layouts reduce in another order: equal up to rounding
            assert abs(a - b) <= 1e-5 * abs(b), (kind, losses, straight)


@pytest.mark.multiprocess
def test_full_checkpoint_is_from_pretrained_loadable(runs):
    from transformers import AutoModelForCausalLM

    step3 = load_pt(runs / "step3.pt")
    model = AutoModelForCausalLM.from_pretrained(runs / "full3")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # stored once, tied again on load
    assert_same_state(
        {k: v.float() for k, v in state_of(model).items()}, {k: v.float() for k, v in step3["state"].items()}
    )
    with torch.no_grad():
        got = model(input_ids=torch.arange(24).reshape(2, 12) % 97).logits
    diff = float((got - step3["logits"]).abs().max())
    print(f"from_pretrained logits vs sharded model: max |diff| {diff:.3g}")
    assert diff <= 1e-5
    # the files a Transformers program expects, and no pickle in the weights
    names = {p.name for p in (runs / "full3").iterdir()}
    assert {"model.safetensors", "config.json", "shardcore.json", "optimizer.safetensors", "optimizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)


@pytest.mark.multiprocess
def test_full_checkpoint_loads_with_plain_load_state_dict(runs):
    from safetensors.torch import load_file

    model = llama(seed=3)
    missing, unexpected = model.load_state_dict(load_file(str(runs / "full3" / "model.safetensors")), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the tied copy, as save_pretrained stores it
    step3 = load_pt(runs / "step3.pt")["state"]
    assert_same_state(state_of(model), step3)
    # and through shardcore.load on one device, with the optimizer state
    model2 = llama(seed=4)
    opt = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.01)
    manifest = shardcore.load(model2, runs / "full3", opt)
    assert manifest["world_size"] == 2 and manifest["state_dict_type"] == "FULL_STATE_DICT"
    assert_same_state(state_of(model2), step3)
    assert len(opt.state) == len(list(model2.parameters())) and all(int(s["step"]) == 3 for s in opt.state.values())


@pytest.mark.multiprocess
def test_sharded_checkpoint_changes_world_size(resumed):
    step3 = load_pt(resumed / "step3.pt")["state"]
    assert_same_state(load_pt(resumed / "world1.pt")["state"], step3)  # 2 -> 1
    assert_same_state(load_pt(resumed / "resume.pt")["sharded_w1"], step3)  # 1 -> 2
    assert json.loads((resumed / "sharded_w1" / "shardcore.json").read_text())["world_size"] == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["single", "hf_single"])
def test_single_device_state_dict_loads_into_fsdp2(resumed, name):
    assert_same_state(load_pt(resumed / "resume.pt")[name], load_pt(resumed / "single.expected.pt"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["hf_single", "full3"])
def test_cpu_ram_efficient_loading_gives_every_rank_the_file_weights(efficient, name):
    per_rank = [json.loads((efficient / f"efficient_{name}.rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(per_rank):
        assert res["on_meta"] == [], f"rank {r} kept meta tensors: {res['on_meta']}"
        assert res["n"] > 0 and res["max_param_diff"] == 0.0, (r, res["max_param_diff"])
        assert "model.rotary_emb.inv_freq" in res["buffers"] and res["max_buffer_diff"] == 0.0
        assert res["tied"]
    assert per_rank[0]["logits"] == per_rank[1]["logits"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_sliced_loading_reads_only_each_ranks_rows_and_matches_the_rank0_path(runs, world):
    """FULL checkpoints (shardcore's, save_pretrained's single file, an index of 3 shards) load with
    every rank reading only its own rows through safetensors' memory maps, at 2 ranks and at 4
    (1x4 and HSDP 2x2): shardcore.load (with the AdamW state) and
    from_pretrained(cpu_ram_efficient_loading) give the shards the rank-0-broadcast path gives,
    bit for bit; no whole file is read; a model sharded
    without weights refuses a forward until it is loaded."""
    index = runs / "hf_index"
    if not index.exists():
        llama(seed=9).save_pretrained(index, max_shard_size="40KB")
    assert len(list(index.glob("model-*.safetensors"))) == 3
    torchrun(world, "sliced", str(runs), timeout=420)
    for r in range(world):
        got = json.loads((runs / f"sliced{world}.rank{r}.json").read_text())
        tags = {"1x2"} if world == 2 else {"1x4", "2x2"}
        assert {k.split("-")[0] for k in got if k != "guard"} == tags
        for case, res in got.items():
            if case == "guard":
                assert res["after_load"], res
                continue
            assert res["load_differs"] == [] and res["pretrained_differs"] == [], (r, case, res)
            assert res["optimizer_differs"] == [], (r, case, res)
            # full3 carries AdamW state: step, exp_avg and exp_avg_sq of every parameter
            want = 3 * res["n_params"] if case.endswith("full3") else 0
            assert res["optimizer_entries"] == want, (r, case, res)
            assert res["same_keys"] and res["logits_equal"] and res["buffers_equal"], (r, case, res)
            assert res["on_meta"] == [] and res["tied"] and res["eval"], (r, case, res)
            # only this rank's rows of every parameter were read, once per load; with the optimizer
            # also its rows of exp_avg and exp_avg_sq and each parameter's step (one element)
            with_optimizer = 3 * res["local_params"] + res["n_params"] if want else res["local_params"]
            assert res["read"] == [with_optimizer, res["local_params"]], (r, case, res)
            shards = int(case.split("-")[0].split("x")[1])
            assert res["local_params"] <= res["whole_params"] // shards + 200, (r, case, res)


@pytest.mark.multiprocess
def test_bad_checkpoints_fail_on_every_rank(runs):
    assert load_pt(runs / "errors.ok") is True  # set by the worker after every expected error was raised


# ------------------------------------------------------------------------------------ killed mid-save


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_killed_save_leaves_previous_checkpoint(tmp_path, kind):
    """SIGKILL every process of a 2-rank run while its second save is on disk but not committed."""
    marker = tmp_path / "saving"
    proc = subprocess.Popen(
        _command(2, "kill", str(tmp_path), kind),
        env=harness.clean_env(CKPT_MARKER=str(marker)),
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
        torchrun(1, "world1_killed", str(tmp_path))
        assert_same_state(load_pt(tmp_path / "killed_sharded.loaded.pt"), expected)
    # the next save succeeds and removes the leftovers of the killed one
    if kind == "FULL_STATE_DICT":
        shardcore.save(model, target)
        assert not partial.exists()


# ------------------------------------------------------------------------------------ one process


def test_single_device_round_trip_with_optimizer(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 13)).sum().backward()
    opt.step()
    shardcore.save(model, tmp_path / "c", opt)
    torch.manual_seed(1)
    other = MLP()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    shardcore.load(other, tmp_path / "c", other_opt)
    assert_same_state(state_of(other), state_of(model))
    a, b = opt.state_dict(), other_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k])


def test_slice_reader_copies_rows_a_piece_at_a_time(tmp_path, monkeypatch):
    """Rows read in pieces (each through its own memory map) equal the slice of the whole tensor,
    for any dtype, a scalar and a tied name stored once."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(37, 5, generator=g),
        "h": torch.randn(11, 3, 2, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.5),
    }
    save_file(tensors, str(tmp_path / "a.safetensors"))
    monkeypatch.setattr(ckpt.full, "SLICE_BYTES", 64)  # 3 rows of w per piece
    opened = []
    real_open = ckpt.full._safetensors()[1]

    def counting_open(*a, **k):
        opened.append(a[0])
        return real_open(*a, **k)

    reader = ckpt.full.SliceReader([tmp_path / "a.safetensors"], {"w_tied": "w"})
    reader._open = counting_open
    out = torch.empty(26, 5)
    reader.fill("w_tied", (slice(3, 29), slice(0, 5)), out)
    assert torch.equal(out, tensors["w"][3:29]) and len(opened) == 9  # ceil(26 / 3) pieces
    out = torch.empty(4, 3, 2)  # a float32 shard of a bfloat16 tensor: cast as load_state_dict casts
    reader.fill("h", (slice(7, 11), slice(0, 3), slice(0, 2)), out)
    assert torch.equal(out, tensors["h"][7:11].float())
    out = torch.empty(())
    reader.fill("s", (), out)
    assert float(out) == 3.5
    with pytest.raises(shardcore.CheckpointError, match="no tensor 'nope'"):
        reader.fill("nope", (slice(0, 1),), torch.empty(1))


def test_init_empty_weights_keeps_buffers_and_a_model_without_weights_waits_for_its_load(tmp_path):
    from shardcore import empty

    with shardcore.init_empty_weights():
        model = llama(seed=0)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plain = llama(seed=0)
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    assert empty.weights_state(model) == "empty" and empty.weights_state(plain) == "real"
    with torch.device("meta"):
        assert empty.weights_state(llama(seed=0)) == "partial"  # rotary inv_freq, in no checkpoint, on meta
    assert not any(p.is_meta for p in llama(seed=0).parameters())  # the context put register_parameter back

    shardcore.save(plain, tmp_path / "ok")
    empty.materialize_empty(model, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    empty.await_weights(model)
    with pytest.raises(shardcore.CheckpointError, match="uninitialized memory"):
        model(input_ids=torch.arange(8).reshape(1, 8))
    with pytest.raises(shardcore.CheckpointError, match="nothing was loaded"):
        shardcore.save(model, tmp_path / "garbage")
    assert not (tmp_path / "garbage").exists()
    shardcore.load(model, tmp_path / "ok")
    assert_same_state(state_of(model), state_of(plain))
    model(input_ids=torch.arange(8).reshape(1, 8))


def test_from_pretrained_without_weights_takes_the_dtype_transformers_would(tmp_path):
    """dtype="auto" (Transformers' default): the config's dtype, else the checkpoint's first float
    tensor's; an explicit dtype wins."""
    from safetensors.torch import save_file

    from shardcore.checkpoint.pretrained import _auto_dtype

    f = tmp_path / "w.safetensors"
    save_file({"a.steps": torch.zeros(2, dtype=torch.int64), "b.weight": torch.zeros(2, dtype=torch.bfloat16)}, str(f))
    cfg = tiny_llama_config()
    cfg.dtype = None
    assert _auto_dtype(cfg, [f], {}) == torch.bfloat16
    assert _auto_dtype(cfg, [f], {"dtype": "auto"}) == torch.bfloat16
    cfg.dtype = torch.float16
    assert _auto_dtype(cfg, [f], {}) == torch.float16
    assert _auto_dtype(cfg, [f], {"torch_dtype": torch.float32}) == torch.float32


def test_plain_safetensors_file_loads(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = MLP()
    save_file(state_of(src), str(tmp_path / "w.safetensors"))
    dst = MLP()
    shardcore.load(dst, tmp_path / "w.safetensors")
    assert_same_state(state_of(dst), state_of(src))


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
