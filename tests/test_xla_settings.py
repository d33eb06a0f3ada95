"""The XLA backend's settings and errors, in this process (no device, no worker): the CPU recipe,
xla_fsdp_settings and their trainer conversions, keys without XLA meaning, refusals made from the
config or the model before any device, the install hint, registration, and the conformance matrix.
"""

import pytest
import torch

import shardcore
from shardcore import BackendUnavailableError, ShardConfigError, UnknownKeyError, UnsupportedKeyError, parse_config
from shardcore_conformance.models import build_model

from xla_helpers import V2, X

pytestmark = pytest.mark.xla  # skipped, saying so, where torch_xla is not installed (conftest.py)


def test_cpu_recipe_problems_and_settings():
    from shardcore_xla import cpu
    from shardcore_xla.settings import check_cpu_fsdp_settings, cpu_fsdp_kwargs, fsdp_kwargs

    good = cpu.recipe_env(4)
    assert cpu.problems(4, good) == []
    assert [p.split()[0] for p in cpu.problems(4, {**good, "PJRT_CPU_ASYNC_CLIENT": "1"})] == ["PJRT_CPU_ASYNC_CLIENT"]
    assert [p.split()[0] for p in cpu.problems(4, {**good, "XLA_THREAD_POOL_SIZE": "3"})] == ["XLA_THREAD_POOL_SIZE"]
    assert [p.split()[0] for p in cpu.problems(4, {**good, "XLA_THREAD_POOL_SIZE": "many"})] == ["XLA_THREAD_POOL_SIZE"]
    assert cpu_fsdp_kwargs({"x": 1}) == {"x": 1, "pin_layout_in_collective_ops": False}
    check_cpu_fsdp_settings(parse_config(X))
    for name in ("pin_layout_in_collective_ops", "sync_on_finalization"):
        cfg = parse_config({**X, "xla_fsdp_settings": {name: False}})
        check_cpu_fsdp_settings(cfg)
        kwargs = cpu_fsdp_kwargs(fsdp_kwargs(cfg))
        assert kwargs["pin_layout_in_collective_ops"] is False and kwargs[name] is False
        with pytest.raises(ShardConfigError) as e:
            check_cpu_fsdp_settings(parse_config({**X, "xla_fsdp_settings": {name: True}}))
        assert e.value.key == f"xla_fsdp_settings.{name}" and "several CPU PJRT devices" in str(e.value)


def test_spmd_refuses_a_meta_model_before_apply(monkeypatch):
    """cpu_ram_efficient_loading under SPMD: the one process is rank 0 and must hold the weights.
    shard() refuses a meta-device model in validate_model, before apply (and before any device)."""
    from shardcore_xla import SpmdBackend

    # validate_model counts the devices, which starts the runtime: it needs a device type
    monkeypatch.setenv("PJRT_DEVICE", "CPU")

    applied = []

    class RecordsApply(SpmdBackend):
        name = "xla-records-apply"

        def apply(self, model, plan, config):
            applied.append(config)
            return super().apply(model, plan, config)

    with pytest.raises(ShardConfigError) as e:
        shardcore.shard(
            build_model("mlp", 0).to("meta"), {**V2, "cpu_ram_efficient_loading": True}, backend=RecordsApply()
        )
    assert e.value.key == "cpu_ram_efficient_loading" and "meta device" in str(e.value), e.value
    assert applied == []


def test_spmd_without_a_device_type_is_a_clear_error(monkeypatch):
    """torch_xla counts no device without PJRT_DEVICE (off a TPU host) and says so in a bare
    RuntimeError. shard() says what to set. The runtime starts once per process, so the count is
    made to fail as torch_xla 2.9's does where it has not started."""
    import torch_xla.runtime as xr

    from shardcore import BackendUnavailableError

    def unset():
        raise RuntimeError("$PJRT_DEVICE is not set.")

    monkeypatch.setattr(xr, "global_runtime_device_count", unset)
    with pytest.raises(BackendUnavailableError, match=r"PJRT_DEVICE is not set.*Set PJRT_DEVICE before the run"):
        shardcore.shard(build_model("mlp", 0), V2, backend="xla")


def test_xla_fsdp_refuses_parameters_that_are_not_float32_by_name():
    """torch_xla's XLA FSDP raises a bare TypeError for any non-fp32 parameter (a bf16 model, or a bf16
    base with PEFT's fp32 LoRA adapters); shardcore names it and the two ways out, before wrapping."""
    from shardcore.errors import WrapPlanError

    with pytest.raises(WrapPlanError) as e:
        shardcore.shard(build_model("mlp", 0).to(torch.bfloat16), X)
    msg = str(e.value)
    assert "blocks.0.fc.weight is bfloat16" in msg and "compute_dtype: bfloat16" in msg and "xla_fsdp_v2: true" in msg


def test_xla_fsdp_refuses_replicas_naming_the_fix():
    """XlaFullyShardedDataParallel's sharding_groups never all-reduce across groups (measured: two
    groups of 2 CPU devices, after 3 steps, give outputs 0.015 apart), so HSDP is SPMD only; refused from the config."""
    from shardcore_xla.settings import check_fsdp_replicas

    with pytest.raises(ShardConfigError) as e:
        shardcore.shard(build_model("mlp", 0), {**X, "dp_replicate_size": 2})
    msg = str(e.value)
    assert e.value.key == "dp_replicate_size" and "is 2" in msg and "set xla_fsdp_v2: true" in msg.lower()
    assert "never all-reduce" in msg and "sharding_groups" in msg
    # from the device count: dp_shard_size 2 of 4 devices makes 2 replicas
    with pytest.raises(ShardConfigError, match="2 replica groups") as e:
        check_fsdp_replicas(parse_config({**X, "dp_shard_size": 2}), 4)
    assert e.value.key == "dp_shard_size"
    check_fsdp_replicas(parse_config({**X, "dp_shard_size": 4}), 4)  # one replica: plain XLA FSDP
    check_fsdp_replicas(parse_config({**X, "dp_replicate_size": 1}), 4)


# --------------------------------------------------------------- settings and errors (no device needed)


def _kwargs(**cfg):
    """The checks validate() runs, then the conversion apply() uses."""
    from shardcore_xla.settings import check_fsdp_settings, fsdp_kwargs

    config = parse_config({"xla": True, **cfg})
    check_fsdp_settings(config)
    return fsdp_kwargs(config)


def test_settings_pass_through_with_trainer_conversions():
    kw = _kwargs(
        xla_fsdp_settings={
            "compute_dtype": "bfloat16",
            "buffer_dtype": "float32",
            "flatten_parameters": True,
            "shard_param_on_dim_0": True,
            "reduce_scatter_bucket_size_mb": 25,
            "sharding_groups": [[0, 1]],
            "fp32_reduce_scatter": True,
        }
    )
    assert kw["compute_dtype"] is torch.bfloat16 and kw["buffer_dtype"] is torch.float32
    assert kw["flatten_parameters"] is True and kw["reduce_scatter_bucket_size_mb"] == 25
    assert kw["sharding_groups"] == [[0, 1]] and kw["reshard_after_forward"] is True
    assert _kwargs(reshard_after_forward=False)["reshard_after_forward"] is False
    # accelerate-style dtype names work too
    assert _kwargs(xla_fsdp_settings={"compute_dtype": "bf16"})["compute_dtype"] is torch.bfloat16


@pytest.mark.parametrize(
    "settings, key, fragment",
    [
        (
            {"compute_dtpye": "bfloat16"},
            "xla_fsdp_settings.compute_dtpye",
            "Did you mean 'xla_fsdp_settings.compute_dtype'",
        ),
        ({"compute_dtype": "bfloat17"}, "xla_fsdp_settings.compute_dtype", "not a dtype"),
        ({"flatten_parameters": "yes"}, "xla_fsdp_settings.flatten_parameters", "true or false"),
        (
            {"reduce_scatter_bucket_size_mb": -1},
            "xla_fsdp_settings.reduce_scatter_bucket_size_mb",
            "non-negative integer",
        ),
        ({"reduce_scatter_bucket_size_mb": 10**5000}, "xla_fsdp_settings.reduce_scatter_bucket_size_mb", "digits"),
        ({"flatten_parameters": [10**5000]}, "xla_fsdp_settings.flatten_parameters", "true or false"),
        ({"sharding_groups": [[0, "a"]]}, "xla_fsdp_settings.sharding_groups", "lists of device ordinals"),
        ({"auto_wrap_policy": "x"}, "xla_fsdp_settings.auto_wrap_policy", "wrap plan"),
        ({"param_init_fn": "x"}, "xla_fsdp_settings.param_init_fn", "callable"),
        ({"_debug_print": True}, "xla_fsdp_settings._debug_print", "Known keys"),
    ],
)
def test_bad_settings(settings, key, fragment):
    with pytest.raises(ShardConfigError) as e:
        _kwargs(xla_fsdp_settings=settings)
    assert e.value.key == key and fragment in str(e.value)


def test_unknown_setting_lists_the_valid_ones():
    with pytest.raises(UnknownKeyError) as e:
        _kwargs(xla_fsdp_settings={"nonsense": 1})
    assert "xla_fsdp_settings.compute_dtype" in str(e.value) and "xla_fsdp_settings.flatten_parameters" in str(e.value)


def test_reshard_conflict_and_spmd_refusals():
    from shardcore_xla.settings import check_spmd_settings

    with pytest.raises(ShardConfigError, match="Keep one"):
        _kwargs(reshard_after_forward=True, xla_fsdp_settings={"reshard_after_forward": False})
    with pytest.raises(ShardConfigError, match="SPMD FSDPv2") as e:
        check_spmd_settings(parse_config({**V2, "xla_fsdp_settings": {"compute_dtype": "bfloat16"}}))
    assert e.value.key == "xla_fsdp_settings.compute_dtype"
    with pytest.raises(ShardConfigError, match="no such setting") as e:
        check_spmd_settings(parse_config({**V2, "reshard_after_forward": False}))
    assert e.value.key == "reshard_after_forward"


@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"cpu_offload": True}, "cpu_offload"),
        ({"activation_checkpointing": True}, "activation_checkpointing"),
        ({"mixed_precision": "bf16"}, "mixed_precision"),
    ],
)
def test_keys_without_xla_meaning_are_errors(cfg, key):
    with pytest.raises(UnsupportedKeyError) as e:
        shardcore.shard(build_model("mlp", 0), {"xla": True, **cfg})
    assert e.value.key == key and "'xla'" in str(e.value)


def test_missing_torch_xla_names_the_install_command(monkeypatch):
    import importlib.util

    import shardcore_xla.backend as xb

    real = importlib.util.find_spec
    monkeypatch.setattr(
        xb.importlib.util, "find_spec", lambda name, *a: None if name == "torch_xla" else real(name, *a)
    )
    with pytest.raises(BackendUnavailableError, match=r"pip install torch==2\.9\.0 torch_xla==2\.9\.0"):
        shardcore.shard(build_model("mlp", 0), {"xla": True})


def test_xla_backend_is_registered_by_entry_point():
    info = {b.name: b for b in shardcore.available_backends()}["xla"]
    assert info.available and info.target == "shardcore_xla:XLABackend"


def test_matrix_leaves_out_only_what_the_backend_refuses(monkeypatch):
    from shardcore_conformance.cases import matrix_for

    backend = shardcore.get_backend("xla")
    with pytest.raises(ShardConfigError):
        backend.validate(parse_config({**V2, "reshard_after_forward": False}))
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    two, four = matrix_for("xla", 2), matrix_for("xla", 4)
    assert [c for c in two if not c.config.get("xla_fsdp_v2") and c.config.get("xla_fsdp_grad_ckpt")]
    assert [c for c in two if c.config.get("xla_fsdp_v2")]
    assert not [c for c in two if c.config.get("xla_fsdp_v2") and c.config.get("reshard_after_forward") is False]
    # HSDP is SPMD only, and has no reshard_after_forward: false there
    hsdp = [c for c in two if c.family == "hsdp"]
    assert hsdp and all(c.config["xla_fsdp_v2"] for c in hsdp) and not [c for c in hsdp if "reshard0" in c.name]

    # the same cases on every device count and device type, but for the HSDP and TP shapes, which
    # follow the world (TP needs pairs of devices), and whose TP cases are SPMD's
    def names(cases):
        return [c.name for c in cases if c.family not in ("hsdp", "tp")]

    assert all(c.config["xla_fsdp_v2"] for c in two + four if c.family == "tp")
    assert [c for c in four if c.family == "tp"] and not [c for c in matrix_for("xla", 1) if c.family == "tp"]

    assert names(matrix_for("xla", 1)) == names(two) == names(matrix_for("xla", 4))
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert [c.name for c in matrix_for("xla", 4)] == [c.name for c in four]
