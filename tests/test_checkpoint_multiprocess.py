"""Checkpoints across real runs, each in new processes (torchrun, ``tests/workers/ckpt_*.py``): exact
resume from FULL and SHARDED, changing the world size and the HSDP layout, single-device and
Transformers interop, cpu_ram_efficient_loading, sliced loading, and bad checkpoints failing on every
rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardcore

from ckpt_helpers import assert_same_state, llama, load_pt, state_of, torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Real runs, each in new processes: 2 ranks train 3 steps, save FULL + SHARDED, train 3 more
    (and check errors); then 1 rank loads the 2-rank SHARDED checkpoint and saves SHARDED again."""
    d = tmp_path_factory.mktemp("ckpt")
    plain = llama(seed=7)
    shardcore.save(plain, d / "single")  # an unsharded model saves FULL with the same code
    plain.save_pretrained(d / "hf_single")
    torch.save(state_of(plain), d / "single.expected.pt")
    torchrun(2, "ckpt_train_save", str(d))
    torchrun(1, "ckpt_reload", str(d / "sharded3"), str(d / "world1.pt"), str(d / "sharded_w1"))
    return d


@pytest.fixture(scope="module")
def resumed(runs) -> Path:
    """2 new ranks resume from both formats, load the 1-rank checkpoint and single-device ones."""
    torchrun(2, "ckpt_resume", str(runs))
    return runs


@pytest.fixture(scope="module")
def efficient(runs) -> Path:
    """2 new ranks: from_pretrained with cpu_ram_efficient_loading."""
    torchrun(2, "ckpt_efficient", str(runs))
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
    torchrun(4, "ckpt_hsdp", str(tmp_path), timeout=420)
    got = load_pt(tmp_path / "hsdp_chain.pt")
    _check_chain(got, lambda layout: layout, [[2, 2], [1, 4], [4, 1]])


def _check_chain(got: dict, layout_of, layouts: list) -> None:
    """Both formats: each run of the chain loaded exactly the parameters and AdamW state the one before
    saved, and the losses of the whole chain are a straight run's."""
    straight = got["straight"]
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        runs = got[kind]
        assert [layout_of(r["layout"]) for r in runs] == layouts
        for before, after in zip(runs, runs[1:]):
            assert_same_state(after["loaded"]["params"], before["saved"]["params"])
            assert_same_state(after["loaded"]["optim"], before["saved"]["optim"])
        losses = [x for r in runs for x in r["losses"]]
        assert len(losses) == len(straight) == 6
        for a, b in zip(losses, straight):  # other layouts reduce in another order: equal up to rounding
            assert abs(a - b) <= 1e-5 * abs(b), (kind, losses, straight)


@pytest.mark.multiprocess
def test_tp_checkpoints_resume_into_other_layouts(tmp_path):
    """4 ranks through (dp_shard 2 x tp 2) -> (dp_shard 4) -> (tp 4) -> (2 replicas x tp 2), both
    formats: every load gives back exactly the parameters and AdamW state the previous layout saved,
    training goes on as a straight run would, and the last FULL checkpoint of a TP model is one
    ``from_pretrained`` loads."""
    from transformers import AutoModelForCausalLM

    torchrun(4, "ckpt_tp", str(tmp_path), timeout=420)
    got = load_pt(tmp_path / "tp_chain.pt")
    _check_chain(got, lambda layout: layout.get("tp_size", 1), [2, 1, 4, 2])
    last = got["FULL_STATE_DICT"][-1]["saved"]["params"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tp-FULL_STATE_DICT-3")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_state({k: v.float() for k, v in state_of(model).items()}, {k: v.float() for k, v in last.items()})


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
    torchrun(world, "ckpt_sliced", str(runs), timeout=420)
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
