"""``torch_compile``: the keys from every config source, what they compile, the XLA refusal, and
FSDP2 training and checkpoints with compiled units (2 gloo ranks)."""

import math

import pytest
import torch
import yaml

import shardcore
from shardcore import ShardConfigError, UnknownKeyError, UnsupportedKeyError, parse_config
from shardcore.compiling import compile_kwargs, compile_targets
from shardcore.plan import build_plan
from shardcore_conformance.models import build_model

import ckpt_helpers


def _yaml(tmp_path, dynamo):
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        yaml.safe_dump({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}, "dynamo_config": dynamo})
    )
    return path


def test_the_keys_from_a_dict_a_json_file_and_training_arguments(tmp_path):
    from transformers import TrainingArguments

    cfg = parse_config({"torch_compile": "true", "torch_compile_mode": "max-autotune", "torch_compile_dynamic": False})
    assert (cfg.torch_compile, cfg.torch_compile_backend, cfg.torch_compile_mode) == (True, None, "max-autotune")
    assert compile_kwargs(cfg) == {"fullgraph": False, "dynamic": False, "mode": "max-autotune"}
    assert parse_config(cfg.to_dict()) == cfg
    f = tmp_path / "fsdp.json"
    f.write_text('{"fsdp_version": 2, "torch_compile": true, "torch_compile_backend": "aot_eager"}')
    assert parse_config(str(f)).torch_compile_backend == "aot_eager"
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile_mode="reduce-overhead", report_to=[])
    cfg = parse_config(args)  # the Trainer turns compilation on and fills in inductor
    assert (cfg.torch_compile, cfg.torch_compile_backend, cfg.torch_compile_mode) == (
        True,
        "inductor",
        "reduce-overhead",
    )
    assert parse_config(TrainingArguments(output_dir=str(tmp_path), report_to=[])).torch_compile is False


def test_a_backend_or_mode_turns_compilation_on_as_in_training_arguments():
    assert parse_config({"torch_compile_backend": "AOT_EAGER"}).torch_compile is True
    assert parse_config({"torch_compile_mode": "default"}).torch_compile is True
    with pytest.raises(ShardConfigError, match="'torch_compile_backend': is 'inductor' but torch_compile is false"):
        parse_config({"torch_compile": False, "torch_compile_backend": "inductor"})
    with pytest.raises(
        ShardConfigError, match="torch_compile_fullgraph.*torch_compile is false.*Set torch_compile: true"
    ):
        parse_config({"torch_compile_fullgraph": True})


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"torch_compile_backend": "indutor"}, "'indutor' is not a torch.compile backend here. Use one of"),
        ({"torch_compile_backend": 3}, "must be a torch.compile backend name"),
        ({"torch_compile_mode": "fast"}, "must be one of default, reduce-overhead, max-autotune"),
        (
            {"torch_compile": True, "torch_compile_dynamic": "sometimes"},
            "'torch_compile_dynamic': must be true or false",
        ),
        ({"torch_compile": "yes"}, "'torch_compile': must be true or false"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(raw, needle):
    with pytest.raises(ShardConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_config(raw)


def test_accelerate_dynamo_config(tmp_path):
    cfg = parse_config(
        str(
            _yaml(
                tmp_path,
                {
                    "dynamo_backend": "INDUCTOR",
                    "dynamo_mode": "max-autotune",
                    "dynamo_use_fullgraph": True,
                    "dynamo_use_dynamic": False,
                    "dynamo_use_regional_compilation": False,
                },
            )
        )
    )
    assert (cfg.torch_compile, cfg.torch_compile_backend, cfg.torch_compile_mode) == (True, "inductor", "max-autotune")
    assert (cfg.torch_compile_fullgraph, cfg.torch_compile_dynamic, cfg.torch_compile_regional) == (True, False, False)
    # what `accelerate config` writes when compilation was not chosen: off, the rest inert as there
    off = parse_config(str(_yaml(tmp_path, {"dynamo_backend": "NO", "dynamo_use_fullgraph": False})))
    assert off.torch_compile is False
    with pytest.raises(
        UnknownKeyError, match="dynamo_config.dynamo_fullgraph.*Did you mean 'dynamo_config.dynamo_use_fullgraph'"
    ):
        parse_config(str(_yaml(tmp_path, {"dynamo_backend": "INDUCTOR", "dynamo_fullgraph": True})))
    with pytest.raises(ShardConfigError, match="'torch_compile_backend': 'NVFUSER' is not a torch.compile backend"):
        parse_config(str(_yaml(tmp_path, {"dynamo_backend": "NVFUSER"})))
    with pytest.raises(ShardConfigError, match="'dynamo_config': must be a mapping"):
        parse_config(str(_yaml(tmp_path, "INDUCTOR")))


def test_what_is_compiled_units_or_the_root():
    model = build_model("llama", 0)
    units = build_plan(model, parse_config({})).modules(model)
    on = parse_config({"torch_compile": True})
    assert compile_targets(model, build_plan(model, on), on) == units and len(units) == 2
    nowrap = on.replace(auto_wrap_policy="NO_WRAP")
    assert compile_targets(model, build_plan(model, nowrap), nowrap) == [model]
    whole = on.replace(torch_compile_regional=False)
    assert compile_targets(model, build_plan(model, whole), whole) == [model]
    assert compile_targets(model, build_plan(model, on), parse_config({})) == []


@pytest.mark.xla
def test_xla_refuses_torch_compile_and_says_why():
    with pytest.raises(UnsupportedKeyError, match="already compiles each step's whole graph"):
        shardcore.shard(torch.nn.Linear(2, 2), {"xla": True, "torch_compile": True})


@pytest.mark.multiprocess
def test_compiled_units_train_like_eager_and_checkpoints_move_both_ways(tmp_path):
    ckpt_helpers.torchrun(2, "compile_ckpt", str(tmp_path))
    r = torch.load(tmp_path / "compile", weights_only=True)
    assert r["units"] == 2 and r["hooked"]  # both decoder layers, still fully_shard's modules
    for got in (r["compiled"], r["user_compiled"]):
        assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(got, r["eager"])), (got, r["eager"])
    assert not [k for k in r["keys"] + r["saved_keys"] if "_orig_mod" in k]
    assert "model.layers.0.self_attn.q_proj.weight" in r["saved_keys"]
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        assert r[kind]["into_eager"] == 0.0 and r[kind]["back_into_compiled"] == 0.0, (kind, r[kind])
        assert r[kind]["resumed"], kind
