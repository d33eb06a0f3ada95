"""WrapPlan: policies, units, tied weights, errors, memory estimate, and the `shardcore plan` CLI."""

import json

import pytest
from torch import nn

from shardcore import WrapPlanError, build_plan, estimate_memory, parse_config
from shardcore.cli import main as cli_main
from shardcore_conformance.models import MLP, build_llama


def plan(model, **cfg):
    return build_plan(model, parse_config(cfg))


def test_transformer_wrap_uses_no_split_modules_of_hf_model():
    model = build_llama()
    p = plan(model)
    assert [u.path for u in p.units] == ["model.layers.0", "model.layers.1"]
    assert {u.cls for u in p.units} == {"LlamaDecoderLayer"}
    assert p.root.is_root and p.root.cls == "LlamaForCausalLM"
    total = sum(par.numel() for par in model.parameters())
    assert sum(u.num_params for u in p.all_units()) == total
    layer = model.model.layers[0]
    assert p.units[0].num_params == sum(par.numel() for par in layer.parameters())
    # every parameter is owned by exactly one unit
    names = [n for u in p.all_units() for n in u.param_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_transformer_wrap_explicit_classes():
    p = plan(build_llama(), transformer_layer_cls_to_wrap="LlamaMLP,LlamaAttention")
    assert [u.path for u in p.units] == [
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.layers.1.self_attn",
        "model.layers.1.mlp",
    ]


def test_nested_units_are_listed_children_first():
    p = plan(build_llama(), transformer_layer_cls_to_wrap=["LlamaDecoderLayer", "LlamaMLP"])
    paths = [u.path for u in p.units]
    assert paths.index("model.layers.0.mlp") < paths.index("model.layers.0")
    mlp_params = sum(x.numel() for x in build_llama().model.layers[0].mlp.parameters())
    layer_params = sum(x.numel() for x in build_llama().model.layers[0].parameters())
    by_path = {u.path: u for u in p.units}
    assert by_path["model.layers.0.mlp"].num_params == mlp_params
    assert by_path["model.layers.0"].num_params == layer_params - mlp_params


def test_size_based_wrap_matches_torch_policy():
    """Same units torch's own size_based_auto_wrap_policy picks."""
    import functools

    from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

    model = MLP()
    ours = [u.path for u in plan(model, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=500).units]
    picked = []

    def wrapper_cls(module, **kwargs):
        picked.append(module)
        return module

    _recursive_wrap(
        model,
        functools.partial(size_based_auto_wrap_policy, min_num_params=500),
        wrapper_cls,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    names = {id(m): n for n, m in model.named_modules()}
    assert ours == [names[id(m)] for m in picked]
    assert ours  # the case is not vacuous


def test_no_wrap_has_only_root():
    model = MLP()
    p = plan(model, auto_wrap_policy="NO_WRAP")
    assert p.units == () and p.root.num_params == sum(x.numel() for x in model.parameters())


def test_missing_class_is_an_error():
    with pytest.raises(WrapPlanError, match="LlamaDecoderLayr") as e:
        plan(build_llama(), transformer_layer_cls_to_wrap=["LlamaDecoderLayr"])
    assert e.value.key == "transformer_layer_cls_to_wrap"
    assert "LlamaDecoderLayer" in str(e.value)  # lists what the model has


def test_no_classes_and_no_no_split_modules_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(WrapPlanError, match="_no_split_modules") as e:
        plan(model)
    assert e.value.key == "transformer_layer_cls_to_wrap"


def test_tied_weights_stay_with_root():
    model = build_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    p = plan(model)  # layers only: tied embedding/head stay in the root
    assert "lm_head.weight" not in [n for u in p.units for n in u.param_names]
    with pytest.raises(WrapPlanError, match="tied"):
        plan(model, transformer_layer_cls_to_wrap=["Embedding"])


def test_memory_estimate_counts_uneven_shards():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1, bias=False))  # weights 5x3, 1x5; bias 5
    est = estimate_memory(model, world_size=2)
    # rank 0 holds ceil(5/2)=3 rows of the 5x3 weight, 3 of the 5 biases, the only row of the 1x5
    assert est.param_bytes == (3 * 3 + 3 + 1 * 5) * 4
    assert est.grad_bytes == est.param_bytes
    assert est.optim_bytes == 2 * est.param_bytes
    assert est.full_param_bytes == (15 + 5 + 5) * 4
    # an async checkpoint copies each rank's shards (SHARDED), and for FULL rank 0 gathers the whole
    assert est.full_optim_bytes == 2 * est.full_param_bytes
    assert est.async_staging_bytes("SHARDED_STATE_DICT") == 3 * est.param_bytes
    assert est.async_staging_bytes("FULL_STATE_DICT") == 3 * est.param_bytes + 3 * (15 + 5 + 5) * 4
    model[1].weight.requires_grad_(False)
    frozen = estimate_memory(model, 2)
    assert frozen.grad_bytes == (3 * 3 + 3) * 4
    assert frozen.async_staging_bytes("FULL_STATE_DICT") == frozen.param_bytes + frozen.optim_bytes + (25 + 2 * 20) * 4


def test_cli_plan_factory(tmp_path, capsys):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"version": 2}))
    assert (
        cli_main(
            ["plan", "--config", str(cfg), "--model", "shardcore_conformance.models:build_llama", "--world-size", "2"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "model.layers.1" in out and "LlamaDecoderLayer" in out and "AdamW state" in out
    assert "CPU memory an async checkpoint save holds" in out and "(rank 0: its shards and the whole)" in out
    assert (
        cli_main(
            [
                "plan",
                "--config",
                str(cfg),
                "--model",
                "shardcore_conformance.models:build_llama",
                "--world-size",
                "4",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    est = estimate_memory(build_llama(), 4)
    assert doc["per_rank_bytes"]["total"] == est.total
    assert doc["async_checkpoint_staging_bytes"] == {
        "FULL_STATE_DICT": est.param_bytes + est.optim_bytes + est.full_param_bytes + est.full_optim_bytes,
        "SHARDED_STATE_DICT": est.param_bytes + est.optim_bytes,
    }
    assert [u["path"] for u in doc["units"]] == ["model.layers.0", "model.layers.1", ""]


def test_cli_plan_hf_config_dir(tmp_path, capsys):
    from shardcore_conformance.models import tiny_llama_config

    tiny_llama_config(num_hidden_layers=3).save_pretrained(tmp_path / "m")
    cfg = tmp_path / "a.yaml"
    cfg.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
    )
    assert cli_main(["plan", "--config", str(cfg), "--model", str(tmp_path / "m"), "--world-size", "2"]) == 0
    assert "model.layers.2" in capsys.readouterr().out


def test_cli_plan_errors_are_clean(tmp_path, capsys):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps({"version": 1}))
    assert cli_main(["plan", "--config", str(cfg), "--model", "shardcore_conformance.models:MLP"]) == 2
    assert "version" in capsys.readouterr().err
    cfg.write_text("{}")
    assert cli_main(["plan", "--config", str(cfg), "--model", "nope"]) == 2
    assert "module:factory" in capsys.readouterr().err


def test_cli_conformance_forwards_to_the_suite(capsys):
    assert cli_main(["conformance", "--backend", "fsdp2", "--list", "--cases", "mlp-nowrap-*"]) == 0
    out = capsys.readouterr().out
    assert "mlp-nowrap-reshard1-ac0" in out and "llama" not in out


def test_cli_plan_shows_per_rank_bytes_under_hsdp(tmp_path, capsys):
    """2 replicas x 2 shards on 4 ranks: each rank holds half the model (one replica's shard), as
    pure sharding over 2 ranks would, not the quarter of pure sharding over 4; an accelerate YAML
    parallelism_config section says so."""
    cfg = tmp_path / "a.yaml"
    cfg.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
        "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_tp_size: 1\n"
    )
    model = "shardcore_conformance.models:build_llama"
    assert cli_main(["plan", "--config", str(cfg), "--model", model, "--world-size", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["dp_replicate_size"], doc["dp_shard_size"]) == (2, 2)
    assert doc["per_rank_bytes"]["total"] == estimate_memory(build_llama(), 2).total
    assert doc["per_rank_bytes"]["total"] > estimate_memory(build_llama(), 4).total
    assert cli_main(["plan", "--config", str(cfg), "--model", model, "--world-size", "4"]) == 0
    assert "dp_replicate 2 x dp_shard 2" in capsys.readouterr().out
    assert cli_main(["plan", "--config", str(cfg), "--model", model, "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "dp_replicate_size" in err and "world size 3 is not a multiple of it" in err
