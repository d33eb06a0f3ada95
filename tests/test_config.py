"""Every config source, and every config error, of ShardConfig."""

import json

import pytest
import torch

import shardcore
from shardcore import ShardConfig, ShardConfigError, UnknownKeyError, parse_config


def test_defaults_match_the_transformers_fsdp2_guide():
    cfg = parse_config({})
    assert cfg.version == 2
    assert cfg.reshard_after_forward is True
    assert cfg.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert cfg.transformer_layer_cls_to_wrap == ()
    assert cfg.state_dict_type == "FULL_STATE_DICT"
    assert cfg.cpu_offload is False and cfg.activation_checkpointing is False
    assert cfg.mixed_precision is None
    assert cfg.backend_name == "fsdp2"


def test_dict_with_fsdp_prefixes_and_comma_string():
    cfg = parse_config(
        {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": "false",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer, MLPBlock",
            "fsdp_offload_params": True,
            "fsdp_state_dict_type": "sharded_state_dict",
        }
    )
    assert cfg.reshard_after_forward is False
    assert cfg.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer", "MLPBlock")
    assert cfg.cpu_offload is True
    assert cfg.state_dict_type == "SHARDED_STATE_DICT"
    assert cfg.explicit >= {"version", "reshard_after_forward", "cpu_offload"}


def test_json_file(tmp_path):
    p = tmp_path / "fsdp.json"
    p.write_text(
        json.dumps(
            {
                "version": 2,
                "auto_wrap_policy": "SIZE_BASED_WRAP",
                "min_num_params": 1e6,
                "activation_checkpointing": True,
                "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            }
        )
    )
    cfg = parse_config(p)
    assert cfg.auto_wrap_policy == "SIZE_BASED_WRAP" and cfg.min_num_params == 1_000_000
    assert cfg.activation_checkpointing is True
    assert cfg.mixed_precision == shardcore.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
    assert cfg.mixed_precision.torch_dtypes()["param_dtype"] is torch.bfloat16
    assert parse_config(str(p)) == cfg


ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_yaml(tmp_path):
    p = tmp_path / "accelerate.yaml"
    p.write_text(ACCELERATE_YAML)
    cfg = parse_config(p)
    assert cfg.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert cfg.cpu_ram_efficient_loading is True
    assert cfg.state_dict_type == "SHARDED_STATE_DICT"
    # accelerate's mixed_precision: bf16 casts parameters and reduces gradients in bf16
    assert cfg.mixed_precision == shardcore.MixedPrecision(param_dtype="bfloat16", reduce_dtype="bfloat16")


def test_accelerate_yaml_is_what_accelerate_itself_reads(tmp_path):
    """The same file through accelerate's own loader gives the same FSDP2 settings."""
    from accelerate.commands.config.config_args import load_config_from_file

    p = tmp_path / "accelerate.yaml"
    p.write_text(ACCELERATE_YAML)
    theirs = load_config_from_file(str(p)).fsdp_config
    ours = parse_config(p)
    assert theirs["fsdp_version"] == ours.version
    assert theirs["fsdp_reshard_after_forward"] == ours.reshard_after_forward
    assert theirs["fsdp_transformer_layer_cls_to_wrap"] == ",".join(ours.transformer_layer_cls_to_wrap)


def test_accelerate_yaml_without_version_is_fsdp1(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: true\n")
    with pytest.raises(ShardConfigError, match="version: 2"):
        parse_config(p)


def test_training_arguments(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        fsdp=True,
        ddp_timeout=77,
        report_to=[],
        fsdp_config={
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "reshard_after_forward": False,
            "cpu_offload": True,
        },
    )
    cfg = parse_config(args)
    assert cfg.transformer_layer_cls_to_wrap == ("LlamaDecoderLayer",)
    assert cfg.reshard_after_forward is False
    assert cfg.cpu_offload is True
    assert cfg.timeout == 77.0
    assert cfg.backend_name == "fsdp2"  # the Trainer's filled-in xla: False defaults select nothing


def test_training_arguments_json_path(tmp_path):
    from transformers import TrainingArguments

    p = tmp_path / "fsdp.json"
    p.write_text(json.dumps({"version": 2, "auto_wrap_policy": "NO_WRAP"}))
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config=str(p), report_to=[])
    assert parse_config(args).auto_wrap_policy == "NO_WRAP"


def test_training_arguments_both_checkpointing_flags_conflict(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        fsdp=True,
        report_to=[],
        activation_checkpointing=True,
        fsdp_config={"activation_checkpointing": True},
    )
    with pytest.raises(ShardConfigError, match="activation_checkpointing") as e:
        parse_config(args)
    assert e.value.key == "activation_checkpointing"


def test_shardconfig_passthrough_and_round_trip():
    cfg = parse_config({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10, "mixed_precision": "fp16"})
    assert parse_config(cfg) is cfg
    assert parse_config(cfg.to_dict()) == cfg
    assert cfg.replace(reshard_after_forward=False).reshard_after_forward is False
    with pytest.raises(Exception):
        cfg.version = 3  # frozen


def test_xla_flag_selects_xla_backend():
    assert parse_config({"xla": True}).backend_name == "xla"
    assert parse_config({"backend": "mybackend"}).backend_name == "mybackend"
    cfg = parse_config(
        {
            "xla": True,
            "xla_fsdp_v2": True,
            "xla_fsdp_grad_ckpt": True,
            "xla_fsdp_settings": {"compute_dtype": "bfloat16"},
        }
    )
    assert cfg.xla_fsdp_settings == {"compute_dtype": "bfloat16"}


@pytest.mark.parametrize(
    "raw, key, fragment",
    [
        ({"reshard_after_froward": True}, "reshard_after_froward", "Did you mean 'reshard_after_forward'"),
        ({"fsdp_min_num_param": 5}, "fsdp_min_num_param", "Did you mean 'min_num_params'"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward", "true or false"),
        ({"reshard_after_forward": "FULL_SHARD"}, "reshard_after_forward", "FSDP1 sharding strategy"),
        ({"cpu_offload": 1}, "cpu_offload", "true or false"),
        ({"version": 1}, "version", "FSDP1"),
        ({"version": "two"}, "version", "integer 2"),
        ({"version": 3}, "version", "must be 2"),
        ({"auto_wrap_policy": "LAYER_WRAP"}, "auto_wrap_policy", "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP"}, "min_num_params", "positive parameter count"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": -5}, "min_num_params", "non-negative integer"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": "lots"}, "min_num_params", "non-negative integer"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1.5}, "min_num_params", "non-negative integer"),
        ({"min_num_params": 100}, "min_num_params", "SIZE_BASED_WRAP"),
        (
            {"auto_wrap_policy": "NO_WRAP", "transformer_layer_cls_to_wrap": ["X"]},
            "transformer_layer_cls_to_wrap",
            "does not use it",
        ),
        ({"transformer_layer_cls_to_wrap": 5}, "transformer_layer_cls_to_wrap", "list of class names"),
        ({"transformer_layer_cls_to_wrap": ["Llama Layer"]}, "transformer_layer_cls_to_wrap", "not a class name"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type", "FULL_STATE_DICT"),
        ({"mixed_precision": "int8"}, "mixed_precision", "not a dtype"),
        # a torch.dtype no name gives would parse once and not read back from its own dict form
        ({"mixed_precision_policy": torch.int8}, "mixed_precision", "not a dtype"),
        ({"mixed_precision": {"param_dtpye": "bf16"}}, "mixed_precision.param_dtpye", "Did you mean"),
        ({"mixed_precision": {"buffer_dtype": "bf16"}}, "mixed_precision.buffer_dtype", "does not cast buffers"),
        ({"backward_prefetch": "BACKWARD_PRE"}, "backward_prefetch", "FSDP1 setting"),
        ({"fsdp_sharding_strategy": "FULL_SHARD"}, "fsdp_sharding_strategy", "reshard_after_forward"),
        ({"xla_fsdp_v2": True}, "xla_fsdp_v2", "xla: true"),
        ({"xla": True, "backend": "fsdp2"}, "backend", "Keep one"),
        ({"xla": True, "xla_fsdp_settings": [1, 2]}, "xla_fsdp_settings", "mapping"),
        ({"timeout": 0}, "timeout", "positive"),
        ({"timeout": "soon"}, "timeout", "seconds"),
        ({"reshard_after_forward": True, "fsdp_reshard_after_forward": False}, "fsdp_reshard_after_forward", "twice"),
    ],
)
def test_errors_name_key_value_and_fix(raw, key, fragment):
    with pytest.raises(ShardConfigError) as e:
        parse_config(raw)
    assert e.value.key == key
    assert fragment in str(e.value)
    assert key in str(e.value)
    assert isinstance(e.value, shardcore.ShardcoreError)


@pytest.mark.parametrize(
    "name, text, error, fragment",
    [
        ("missing.json", None, ShardConfigError, "not a file"),
        ("bad.json", "{not json", ShardConfigError, "not valid JSON"),
        ("list.json", "[1, 2]", ShardConfigError, "JSON object"),
        (
            "a.yaml",
            "distributed_type: MULTI_GPU\nfsdp_config: {fsdp_version: 2}\n",
            ShardConfigError,
            "distributed_type",
        ),
        ("b.yaml", "distributed_tpye: FSDP\nfsdp_config: {fsdp_version: 2}\n", UnknownKeyError, "distributed_type"),
    ],
)
def test_bad_config_files(tmp_path, name, text, error, fragment):
    p = tmp_path / name
    if text is not None:
        p.write_text(text)
    with pytest.raises(error, match=fragment):
        parse_config(p)


def test_bad_source_type():
    with pytest.raises(ShardConfigError, match="cannot read a config"):
        parse_config(42)


def test_non_default_keys_drive_backend_support():
    cfg = parse_config({"xla": False, "cpu_offload": False, "reshard_after_forward": False})
    assert cfg.non_default_keys() == ["reshard_after_forward"]
    assert ShardConfig().non_default_keys() == []


# ------------------------------------------------------------------------------ HSDP (accelerate's ParallelismConfig)


def test_hsdp_sizes_from_every_source(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    assert parse_config({}).dp_replicate_size is None and parse_config({}).dp_shard_size is None
    cfg = parse_config({"dp_replicate_size": 2, "dp_shard_size": "4"})
    assert (cfg.dp_replicate_size, cfg.dp_shard_size) == (2, 4)
    nested = parse_config({"parallelism_config": {"parallelism_config_dp_replicate_size": 2, "tp_size": 1}})
    assert nested.dp_replicate_size == 2 and nested.dp_shard_size is None
    yaml_file = tmp_path / "a.yaml"
    yaml_file.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"
        "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
        "  parallelism_config_tp_size: 1\n  parallelism_config_cp_size: 1\n  parallelism_config_cp_backend: torch\n"
    )
    assert (parse_config(yaml_file).dp_replicate_size, parse_config(yaml_file).dp_shard_size) == (2, 2)
    args = TrainingArguments(
        output_dir=str(tmp_path / "o"),
        fsdp="full_shard",
        fsdp_config={"version": 2},
        parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=3),
    )
    assert (parse_config(args).dp_replicate_size, parse_config(args).dp_shard_size) == (2, 3)


@pytest.mark.parametrize(
    "raw, key, fragment",
    [
        ({"dp_shard_size": 0}, "dp_shard_size", "positive integer"),
        ({"dp_replicate_size": True}, "dp_replicate_size", "positive integer"),
        ({"dp_replicate_size": 2.5}, "dp_replicate_size", "positive integer"),
        ({"parallelism_config": {"parallelism_config_tp_size": 0}}, "tp_size", "positive integer"),
        ({"parallelism_config": {"cp_size": 4}}, "parallelism_config.cp_size", "context or sequence parallelism"),
        ({"parallelism_config": {"sp_size": 2}}, "parallelism_config.sp_size", "context or sequence parallelism"),
        ({"parallelism_config": {"dp_replicat_size": 2}}, "parallelism_config.dp_replicat_size", "Did you mean"),
        ({"parallelism_config": 3}, "parallelism_config", "must be a mapping"),
    ],
)
def test_bad_hsdp_sizes_name_the_key(raw, key, fragment):
    with pytest.raises(shardcore.ShardConfigError, match=fragment) as e:
        parse_config(raw)
    assert e.value.key == key


@pytest.mark.parametrize(
    "sizes, world, shape",
    [
        ((None, None), 4, (1, 4)),
        ((2, None), 4, (2, 2)),
        ((None, 1), 4, (4, 1)),
        ((2, 2), 4, (2, 2)),
        ((1, 4), 4, (1, 4)),
    ],
)
def test_hsdp_shape_follows_accelerate(sizes, world, shape):
    from shardcore.validate import data_parallel_shape

    cfg = parse_config({"dp_replicate_size": sizes[0], "dp_shard_size": sizes[1]})
    assert data_parallel_shape(cfg, world) == shape


@pytest.mark.parametrize(
    "sizes, key, fragment",
    [
        ((3, None), "dp_replicate_size", "world size 4 is not a multiple of it"),
        ((2, 3), "dp_replicate_size", "make 6 ranks"),
    ],
)
def test_hsdp_shape_that_does_not_factor_the_world_is_refused(sizes, key, fragment):
    from shardcore.validate import data_parallel_shape

    cfg = parse_config({"dp_replicate_size": sizes[0], "dp_shard_size": sizes[1]})
    with pytest.raises(shardcore.ShardConfigError, match=fragment) as e:
        data_parallel_shape(cfg, 4)
    assert e.value.key == key and "dp_shard_size" in str(e.value)


def test_a_backend_without_hsdp_refuses_its_keys():
    # XLA takes the keys now (SPMD only: tests/test_xla_settings.py), so a test backend that never declared them
    with pytest.raises(shardcore.UnsupportedKeyError, match="dp_replicate_size") as e:
        shardcore.shard(torch.nn.Linear(2, 2), {"dp_replicate_size": 2}, backend="backends_for_tests:PlainBackend")
    assert e.value.key == "dp_replicate_size" and "'plain' backend" in str(e.value)
