"""Tensor parallelism's config and plan, in one process: every source of ``tp_size`` and
``tp_plan``, the plan resolved against real Hugging Face models, and every refusal before anything
is sharded. The multi-rank runs are the conformance suite's ``tp`` family
(tests/test_conformance_cli.py)."""

import json
import re

import pytest
import torch

import shardcore
from shardcore import ShardConfigError, parse_config
from shardcore.capabilities import TensorParallel
from shardcore.plan import build_plan
from shardcore.tp import pattern_regex
from shardcore.validate import data_parallel_shape
from shardcore_conformance.models import _tiny_model, build_llama

LLAMA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def llama(**kw):
    return build_llama(**{"vocab_size": 96, **kw})


def test_tp_keys_from_every_source(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    assert parse_config({}).tp_size == 1 and parse_config({}).tp_plan is None
    plan = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    assert parse_config({"tp_size": "2", "tp_plan": "AUTO"}).tp_plan == "auto"
    assert parse_config({"fsdp_tp_size": 2, "tp_plan": json.dumps(plan)}).tp_plan == plan
    js = tmp_path / "fsdp.json"
    js.write_text(json.dumps({"version": 2, "tp_size": 2, "tp_plan": plan}))
    assert (parse_config(js).tp_size, parse_config(js).tp_plan) == (2, plan)
    yaml_file = tmp_path / "a.yaml"
    yaml_file.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 1\n"
    )
    cfg = parse_config(yaml_file)
    assert (cfg.dp_shard_size, cfg.tp_size) == (2, 2)
    assert parse_config({"parallelism_config": {"tp_size": 4}}).tp_size == 4
    args = TrainingArguments(
        output_dir=str(tmp_path / "o"),
        fsdp=True,
        fsdp_config={"version": 2},
        parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2),
    )
    assert (parse_config(args).dp_shard_size, parse_config(args).tp_size) == (2, 2)
    # the object itself, as accelerate's Accelerator takes it
    assert parse_config({"parallelism_config": ParallelismConfig(tp_size=2)}).tp_size == 2
    assert parse_config(parse_config({"tp_size": 2, "tp_plan": plan}).to_dict()).tp_plan == plan


@pytest.mark.parametrize(
    "raw, key, fragment",
    [
        ({"tp_size": 0}, "tp_size", "positive integer"),
        ({"tp_size": 1.5}, "tp_size", "positive integer"),
        ({"tp_size": 2, "tp_plan": ["colwise"]}, "tp_plan", "mapping of module-name pattern -> style"),
        ({"tp_size": 2, "tp_plan": "{not json"}, "tp_plan", "not valid JSON"),
        ({"tp_size": 2, "tp_plan": {"lm_head": "colwize"}}, "tp_plan", "pattern 'lm_head' the style 'colwize', not a"),
        ({"tp_size": 2, "tp_plan": {"lm_head": "packed_colwise"}}, "tp_plan", "shardcore does not apply"),
        ({"tp_plan": "auto"}, "tp_plan", "tp_size is 1"),
        ({"parallelism_config": {"cp_size": 2}}, "parallelism_config.cp_size", "context or sequence parallelism"),
    ],
)
def test_bad_tp_config_names_the_key(raw, key, fragment):
    with pytest.raises(ShardConfigError, match=fragment) as e:
        parse_config(raw)
    assert e.value.key == key


def test_async_tp_is_refused_not_ignored():
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import TorchTensorParallelConfig

    pc = ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(enable_async_tp=True))
    with pytest.raises(ShardConfigError, match="Set enable_async_tp=False") as e:
        parse_config({"parallelism_config": pc})
    assert e.value.key == "parallelism_config.tp_handler.enable_async_tp"


@pytest.mark.parametrize(
    "sizes, world, shape",
    [((None, None), 4, (1, 2)), ((2, None), 4, (2, 1)), ((None, 2), 8, (2, 2)), ((1, 1), 2, (1, 1))],
)
def test_tp_is_the_innermost_dim_of_the_world(sizes, world, shape):
    r, s = sizes
    cfg = parse_config({"dp_replicate_size": r, "dp_shard_size": s, "tp_size": 2})
    assert data_parallel_shape(cfg, world) == shape


@pytest.mark.parametrize(
    "raw, world, key, fragment",
    [
        ({"tp_size": 4}, 6, "tp_size", "world size 6 is not a multiple of it"),
        ({"tp_size": 2, "dp_shard_size": 3}, 4, "dp_shard_size", "data-parallel size 2 (world size 4 / tp_size 2)"),
        ({"tp_size": 2, "dp_shard_size": 2, "dp_replicate_size": 2}, 4, "dp_replicate_size", "make 8 ranks"),
    ],
)
def test_a_world_the_mesh_does_not_cover_is_refused(raw, world, key, fragment):
    with pytest.raises(ShardConfigError, match=re.escape(fragment)) as e:
        data_parallel_shape(parse_config(raw), world)
    assert e.value.key == key


def test_auto_is_the_models_own_plan_under_full_names():
    plan = build_plan(llama(), parse_config({"tp_size": 2})).tp
    styles = plan.as_dict()
    assert plan.size == 2 and plan.source == "the model's tp_plan"
    # base_model_tp_plan under "model.", the head's own entry, the embedding transformers adds
    assert (
        styles["model.layers.1.self_attn.k_proj"] == "colwise" and styles["model.layers.0.mlp.down_proj"] == "rowwise"
    )
    assert styles["lm_head"] == "colwise_gather_output" and styles["model.embed_tokens"] == "embedding_rowwise"
    assert len(styles) == 2 + 2 * 7
    dims = plan.split_dims()
    assert dims["model.layers.0.self_attn.o_proj.weight"] == 1 and dims["model.layers.0.self_attn.q_proj.weight"] == 0
    assert "model.layers.0.self_attn.o_proj.bias" not in dims and dims["model.embed_tokens.weight"] == 0
    assert "tensor parallel: tp_size 2" in build_plan(llama(), parse_config({"tp_size": 2})).describe()


def test_a_tied_embedding_split_one_way_is_accepted_and_two_ways_refused():
    qwen = _tiny_model("qwen2", {})
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    plan = build_plan(qwen, parse_config({"tp_size": 2})).tp
    assert plan.split_dims()["model.layers.0.self_attn.q_proj.bias"] == 0  # a colwise bias is split too
    bad = {"model.embed_tokens": "embedding_colwise", "lm_head": "colwise"}
    with pytest.raises(ShardConfigError, match="splits the tied weight model.embed_tokens.weight two ways") as e:
        build_plan(_tiny_model("qwen2", {}), parse_config({"tp_size": 2, "tp_plan": bad}))
    assert e.value.key == "tp_plan"


def test_a_star_stands_for_one_part_of_the_name():
    rx = pattern_regex("model.layers.*.mlp.up_proj")
    assert rx.match("model.layers.11.mlp.up_proj")
    assert not rx.match("model.layers.1.2.mlp.up_proj") and not rx.match("model.layers.1.mlp.up_proj.lora_A")
    assert not pattern_regex("layers.*.mlp.up_proj").match("model.layers.1.mlp.up_proj")


@pytest.mark.parametrize(
    "build, raw, key, fragment",
    [
        # the conformance Llama's vocabulary is 97 rows, which 2 ranks cannot split evenly
        (
            lambda: build_llama(),
            {"tp_size": 2},
            "tp_size",
            "does not divide the 97 rows (vocabulary) of model.embed_tokens",
        ),
        (llama, {"tp_size": 4}, "tp_size", "does not divide the model's num_key_value_heads (2)"),
        (
            lambda: llama(num_attention_heads=2, num_key_value_heads=1),
            {"tp_size": 2},
            "tp_size",
            "num_key_value_heads (1)",
        ),
        (
            lambda: llama(intermediate_size=55),
            {"tp_size": 2},
            "tp_size",
            "55 output features of model.layers.0.mlp.gate_proj",
        ),
        (llama, {"tp_size": 2, "tp_plan": {"layers.*.mlp.up_proj": "colwise"}}, "tp_plan", "matches no module"),
        (llama, {"tp_size": 2, "tp_plan": {"model.layers.*.mlp": "colwise"}}, "tp_plan", "splits Linear layers only"),
        (llama, {"tp_size": 2, "tp_plan": {"model.embed_tokens": "colwise"}}, "tp_plan", "splits Linear layers only"),
        (llama, {"tp_size": 2, "tp_plan": {"lm_head": "embedding_rowwise"}}, "tp_plan", "splits Embedding layers only"),
        (
            llama,
            {
                "tp_size": 2,
                "tp_plan": {"model.layers.*.mlp.up_proj": "colwise", "model.layers.0.mlp.up_proj": "rowwise"},
            },
            "tp_plan",
            "two styles",
        ),
        (
            lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)),
            {"tp_size": 2, "auto_wrap_policy": "NO_WRAP"},
            "tp_plan",
            "carries no tensor-parallel plan",
        ),
    ],
)
def test_a_plan_the_model_cannot_take_is_refused_before_sharding(build, raw, key, fragment):
    with pytest.raises(ShardConfigError, match=re.escape(fragment)) as e:
        build_plan(build(), parse_config(raw))
    assert e.value.key == key


def test_a_model_plan_naming_a_style_shardcore_does_not_apply_is_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=56,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    with pytest.raises(
        ShardConfigError, match="'replicated_with_grad_allreduce', a transformers tensor-parallel style"
    ) as e:
        build_plan(model, parse_config({"tp_size": 2}))
    assert e.value.key == "tp_plan" and "Qwen3ForCausalLM's own pattern 'model.layers.*.self_attn.q_norm'" in str(
        e.value
    )


def test_lora_with_tp_is_refused_by_name():
    from shardcore_conformance.models import build_lora

    with pytest.raises(ShardConfigError, match="does not split LoRA adapters across tensor-parallel ranks yet") as e:
        build_plan(build_lora("llama"), parse_config({"tp_size": 2}))
    assert e.value.key == "tp_size"


def test_fsdp2_declares_tensor_parallelism():
    backend = shardcore.get_backend("fsdp2")
    assert {"tp_size", "tp_plan"} <= backend.supported_keys and isinstance(backend, TensorParallel)


@pytest.mark.xla
def test_xla_fsdp_refuses_tp_by_name_and_spmd_takes_it():
    from shardcore.backend import resolve_backend

    with pytest.raises(shardcore.UnsupportedKeyError, match="Set xla_fsdp_v2: true for tensor parallelism") as e:
        resolve_backend(parse_config({"xla": True, "tp_size": 2}), None)
    assert e.value.key == "tp_size"
    spmd = resolve_backend(parse_config({"xla": True, "xla_fsdp_v2": True, "tp_size": 2}), None)
    assert {"tp_size", "tp_plan"} <= spmd.supported_keys and isinstance(spmd, TensorParallel)
    from shardcore_conformance.cases import matrix_for

    for devices, tag in ((2, "tp2"), (4, "dp2-tp2")):
        tp = {c.name: c for c in matrix_for("xla", devices) if c.family == "tp"}
        assert {f"{tag}-llama", f"{tag}-qwen2", f"{tag}-llama-plan", f"{tag}-llama-gc1"} <= set(tp), sorted(tp)
        assert all(c.config["xla_fsdp_v2"] and c.config["tp_size"] == 2 for c in tp.values())


@pytest.mark.xla
def test_spmd_marks_a_split_dim_on_tensor_and_another_on_fsdp():
    from shardcore_xla.spmd import tp_spec

    assert tp_spec((64, 16), 0) == ("tensor", "fsdp")  # colwise: output features split
    assert tp_spec((16, 64), 1) == ("fsdp", "tensor")  # rowwise: input features split
    assert tp_spec((64,), 0) == (("tensor", "fsdp"),)  # a colwise bias: each tp slice sharded again
    assert tp_spec((96, 16), 0) == ("tensor", "fsdp")  # the vocabulary of an embedding


def test_compiled_tp_is_refused_on_a_torch_release_it_was_not_certified_on():
    """The suite certified compiled TP on torch 2.9 and 2.13 (on 2.13 once the layers' outputs settle in
    eager: test_an_eager_split_layer_hands_a_compiled_unit_a_plain_tensor); on a release between, or
    a newer one, it is refused before anything is sharded, and the conformance matrix leaves the
    compiled TP case out where the backend refuses it."""
    from shardcore_fsdp2.tensor_parallel import check_compiled_tp, compiled_tp_certified

    compiled_tp = parse_config({"tp_size": 2, "torch_compile": True})
    check_compiled_tp(compiled_tp, "2.9.0+cu128")
    check_compiled_tp(compiled_tp, "2.13.0+cpu")
    check_compiled_tp(parse_config({"tp_size": 2}), "2.11.0")
    check_compiled_tp(parse_config({"torch_compile": True}), "2.11.0")
    with pytest.raises(
        ShardConfigError, match=r"certified on torch 2\.9, 2\.13 only, and this is torch 2\.11\.0.*torch_compile: false"
    ) as e:
        check_compiled_tp(compiled_tp, "2.11.0")
    assert e.value.key == "torch_compile"
    backend = shardcore.get_backend("fsdp2")
    certified = compiled_tp_certified()
    try:
        backend.validate(compiled_tp)
        refused = False
    except ShardConfigError:
        refused = True
    assert refused is not certified
    from shardcore_conformance.cases import matrix_for

    assert ("dp2-tp2-compile-llama" in {c.name for c in matrix_for("fsdp2", 4)}) is certified


def test_an_eager_split_layer_hands_a_compiled_unit_a_plain_tensor():
    """DTensor's styles return an AsyncCollectiveTensor that waits at its first use; torch 2.13's
    compiler gave such an input of a compiled unit no gradient, so with torch_compile the
    vocabulary-split embedding trained on nothing. shardcore's styles settle their output where they
    run eagerly. On a 1-rank ``tp`` mesh, in this process: the same hooks run."""
    import dataclasses

    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh

    from shardcore.distributed import ensure_process_group
    from shardcore_fsdp2 import tensor_parallel

    ensure_process_group(60.0, "cpu", False)
    model = llama()
    plan = dataclasses.replace(build_plan(model, parse_config({"tp_size": 2})).tp, size=1)
    tensor_parallel.apply(model, plan, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    outputs = {}
    for name in ("model.embed_tokens", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj", "lm_head"):
        model.get_submodule(name).register_forward_hook(lambda m, i, o, n=name: outputs.__setitem__(n, o))
    ids = torch.arange(32).reshape(2, 16) % 96
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(outputs) == 4
    for name, out in outputs.items():
        assert type(out) is torch.Tensor and not isinstance(out, AsyncCollectiveTensor), (name, type(out))
        assert out.grad_fn is not None, name
    assert model.model.embed_tokens.weight.grad.to_local().abs().sum() > 0


def test_the_matrix_has_a_tp_family_at_two_and_four_ranks():
    from shardcore_conformance.cases import LOW_PRECISION_LR, matrix_for

    two = {c.name: c for c in matrix_for("fsdp2", 2) if c.family == "tp"}
    four = {c.name: c for c in matrix_for("fsdp2", 4) if c.family == "tp"}
    assert {"tp2-llama", "tp2-qwen2", "tp2-llama-plan", "tp2-llama-ac1", "tp2-grad_accum-llama"} <= set(two)
    assert {
        "tp2-clip-llama",
        "tp2-llama-resume",
        "tp2-llama-sharded_state_dict",
        "tp2-qwen2-sharded_state_dict",
    } <= set(two)
    assert {"dp2-tp2-llama", "dp2-tp2-llama-sharded_state_dict", "hsdp2x1-tp2-llama"} <= set(four)
    assert all(c.config["tp_size"] == 2 for c in [*two.values(), *four.values()])
    assert four["hsdp2x1-tp2-llama"].config["dp_replicate_size"] == 2
    # bf16: FSDP2's mixed precision on each model and clipped, and a model whose weights are bf16,
    # at the low-precision learning rate every bf16 case trains at
    for tag, cases in (("tp2", two), ("dp2-tp2", four)):
        bf16 = {n for n, c in cases.items() if c.dtype == "bf16"}
        mp = {f"{tag}-llama-mp-bf16", f"{tag}-qwen2-mp-bf16", f"{tag}-clip-llama-mp-bf16"}
        assert bf16 == mp | {f"{tag}-llama-bf16_weights"}, sorted(bf16)
        assert all(cases[n].config["mixed_precision"] == "bf16" for n in mp)
        assert all(cases[n].lr == LOW_PRECISION_LR for n in bf16)
    # every case builds: its model takes the plan
    for c in two.values():
        from shardcore_conformance.models import build_model

        assert build_plan(build_model(c.model, 0), parse_config(c.config)).tp is not None, c.name


@pytest.mark.xla
def test_spmds_bf16_tp_case_is_a_model_whose_weights_are_bf16():
    """SPMD has no mixed-precision key (it refuses xla_fsdp_settings), so its tp family computes in
    bf16 through the model's own dtype."""
    from shardcore_conformance.cases import LOW_PRECISION_LR, matrix_for

    spmd = {c.name: c for c in matrix_for("xla", 2) if c.family == "tp" and c.dtype == "bf16"}
    assert list(spmd) == ["tp2-llama-bf16_weights"], sorted(spmd)
    case = spmd["tp2-llama-bf16_weights"]
    assert case.model == "llama_tp_bf16" and case.lr == LOW_PRECISION_LR and case.config["xla_fsdp_v2"]


def test_shared_inputs_are_not_kept_past_a_checkpointed_backward():
    """Column splits of one parent share one DTensor of their input through a per-parent cache that
    the parent's forward empties when it ends. Activation checkpointing's recomputation (torch's
    early stop on) may end inside the MLP, before that hook: it must not fill the cache, or the MLP's
    recomputed input would live until the next step. On a world of one, in this process: the split
    is over a 1-rank ``tp`` mesh, which runs the same hooks."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from shardcore.distributed import ensure_process_group
    from shardcore_fsdp2 import tensor_parallel
    from shardcore_fsdp2.backend import checkpoint_forward

    ensure_process_group(60.0, "cpu", False)
    model = llama()
    plan = dataclasses.replace(build_plan(model, parse_config({"tp_size": 2})).tp, size=1)
    tensor_parallel.apply(model, plan, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    model.config.use_cache = False  # a KV cache filled again by the recomputation (shard() turns it off)
    for layer in model.model.layers:
        checkpoint_forward(layer)
    caches = {
        id(m._shardcore_tp_inputs): m._shardcore_tp_inputs
        for m in model.modules()
        if hasattr(m, "_shardcore_tp_inputs")
    }
    assert len(caches) == 2 * len(model.model.layers) + 1  # attention, MLP, and the root's head
    ids = torch.arange(32).reshape(2, 16) % 96
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(not c for c in caches.values()), [len(c) for c in caches.values()]
    assert all(p.grad is not None for p in model.parameters())


def test_two_vocabulary_splits_of_one_shape_and_two_dtypes_run_in_one_process():
    """torch 2.9's DTensor planner cached a redistribution by a ``_MaskPartial`` placement that
    compares equal to another embedding's, so the second of two vocabulary-split embeddings of one
    shape, in another dtype, failed its forward (``assert self.mask_buffer.data is not None``);
    shardcore empties that cache before such an embedding runs. A 1-rank ``tp`` mesh takes the same
    path (tensor_parallel.MASK_CACHE_FIXED: the release that no longer needs it)."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from shardcore.distributed import ensure_process_group
    from shardcore_fsdp2 import tensor_parallel

    ensure_process_group(60.0, "cpu", False)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    ids = torch.arange(32).reshape(2, 16) % 96
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        model = llama().to(dtype)
        plan = dataclasses.replace(build_plan(model, parse_config({"tp_size": 2})).tp, size=1)
        assert dict(plan.styles)["model.embed_tokens"] == "embedding_rowwise"
        tensor_parallel.apply(model, plan, mesh)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss), dtype
