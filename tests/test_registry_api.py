"""Backend registry, backend selection errors, and shard() checks that need no second process."""

import pytest
import torch

import shardcore
from shardcore import (
    AlreadyShardedError,
    BackendNotFoundError,
    BackendUnavailableError,
    ShardConfigError,
    UnsupportedKeyError,
)
from shardcore_conformance.models import MLP, build_llama

import harness


def test_fsdp2_is_registered_by_entry_point():
    infos = {b.name: b for b in shardcore.available_backends()}
    assert infos["fsdp2"].available, infos["fsdp2"].reason
    assert infos["fsdp2"].target == "shardcore_fsdp2:FSDP2Backend"
    from importlib.metadata import entry_points

    assert "fsdp2" in {ep.name for ep in entry_points(group="shardcore.backends")}


# a fresh interpreter is the honest check: this process has imported every backend already
@pytest.mark.multiprocess
def test_core_never_imports_backends_by_name():
    out = harness.python(harness.worker("core_imports"), timeout=120, fresh=True)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    assert out.stdout.strip() == "[]"


def test_unknown_backend_lists_installed_ones():
    with pytest.raises(BackendNotFoundError, match="fsdp2") as e:
        shardcore.shard(MLP(), {"backend": "tpu9000"})
    assert "tpu9000" in str(e.value) and "pip install" in str(e.value)


def test_unavailable_backend_names_install_command(mlp):
    with pytest.raises(BackendUnavailableError, match="pip install shardcore-unavailable-example"):
        shardcore.shard(mlp, {}, backend="backends_for_tests:UnavailableBackend")


def test_key_the_backend_does_not_support_is_an_error(mlp):
    with pytest.raises(UnsupportedKeyError, match="reshard_after_forward") as e:
        shardcore.shard(mlp, {"reshard_after_forward": False}, backend="backends_for_tests:OnlyWrapBackend")
    assert e.value.key == "reshard_after_forward"
    assert "only-wrap" in str(e.value)


def test_unloadable_backend_target():
    with pytest.raises(BackendUnavailableError, match="no_such_module"):
        shardcore.get_backend("no_such_module:Backend")


def test_not_a_module():
    with pytest.raises(shardcore.ShardcoreError, match="torch.nn.Module"):
        shardcore.shard("model", {})


def test_activation_checkpointing_conflicts_with_model_gradient_checkpointing(tiny_llama):
    tiny_llama.activation_checkpointing_enable()
    with pytest.raises(ShardConfigError, match="gradient checkpointing enabled") as e:
        shardcore.shard(tiny_llama, {"activation_checkpointing": True})
    assert e.value.key == "activation_checkpointing"


def test_activation_checkpointing_needs_units(mlp):
    with pytest.raises(ShardConfigError, match="no units") as e:
        shardcore.shard(mlp, {"activation_checkpointing": True, "auto_wrap_policy": "NO_WRAP"})
    assert e.value.key == "activation_checkpointing"


# The checks below shard for real in a world of one (a single-process gloo group).


def test_shard_twice_is_an_error(mlp):
    model = shardcore.shard(mlp, {})
    with pytest.raises(AlreadyShardedError, match="already sharded"):
        shardcore.shard(model, {})


def test_shard_returns_the_same_module_with_dtensor_params_and_handle():
    from torch.distributed.tensor import DTensor

    model = MLP()
    out = shardcore.shard(model, {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1150})
    assert out is model
    assert all(isinstance(p, DTensor) for p in model.parameters())
    h = shardcore.handle(model)
    assert h.backend.name == "fsdp2" and h.config.auto_wrap_policy == "SIZE_BASED_WRAP"
    # blocks.1/2 hold 1,188 parameters each (>= 1,150); blocks.0 (528) and the head go to the root
    assert [u.path for u in h.plan.units] == ["blocks.1", "blocks.2"]
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model.blocks[1], FSDPModule) and isinstance(model, FSDPModule)
    assert not isinstance(model.blocks[0], FSDPModule) and not isinstance(model.head, FSDPModule)


def test_activation_checkpointing_recomputes_each_unit_in_backward():
    """The unit's forward runs twice per step with checkpointing (forward + recompute), once without."""

    def forwards_per_step(ac: bool) -> int:
        model = MLP()
        calls = []
        model.blocks[1].fc.register_forward_hook(lambda *a: calls.append(1))
        model = shardcore.shard(model, {"activation_checkpointing": ac})
        model(torch.randn(4, 13)).sum().backward()
        return len(calls)

    assert forwards_per_step(False) == 1
    assert forwards_per_step(True) == 2


def test_activation_checkpointing_keeps_parameter_names_and_turns_off_kv_cache():
    model = build_llama()
    names = [n for n, _ in model.named_parameters()]
    shardcore.shard(model, {"activation_checkpointing": True})
    assert [n for n, _ in model.named_parameters()] == names
    assert model.config.use_cache is False


def test_mixed_precision_computes_in_param_dtype():
    seen = []
    model = MLP()
    model.blocks[0].fc.register_forward_pre_hook(lambda m, a: seen.append((m.weight.dtype, a[0].dtype)))
    model = shardcore.shard(model, {"mixed_precision": "bf16"})
    model(torch.randn(4, 13)).float().sum().backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded master weights stay fp32


def test_reshard_after_forward_frees_gathered_params():

    def unit_is_sharded_after_forward(flag: bool) -> bool:
        model = shardcore.shard(MLP(), {"reshard_after_forward": flag})
        model(torch.randn(4, 13))
        # after forward, a resharded unit holds its parameters as sharded DTensors again
        from torch.distributed.tensor import DTensor

        return isinstance(model.blocks[0].fc.weight, DTensor)

    assert unit_is_sharded_after_forward(True) is True
    assert unit_is_sharded_after_forward(False) is False


def test_mesh_follows_a_new_process_group():
    """After the script replaces the process group, shard() builds its mesh on the new one."""
    import torch.distributed as dist

    first = shardcore.shard(MLP(), {})
    mesh = shardcore.handle(first).backend.mesh(shardcore.handle(first).config)
    dist.destroy_process_group()
    second = shardcore.shard(MLP(), {})
    new_mesh = shardcore.handle(second).backend.mesh(shardcore.handle(second).config)
    assert new_mesh is not mesh
    assert new_mesh.get_group() is dist.group.WORLD


def _every_error_class():
    import shardcore.errors as errors

    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, shardcore.ShardcoreError)]


@pytest.mark.parametrize("cls", _every_error_class(), ids=lambda c: c.__name__)
def test_every_error_message_starts_with_one_prefix(cls):
    if issubclass(cls, shardcore.UnknownKeyError):
        err = cls("fsdp_bogus", ["reshard_after_forward"])
    elif issubclass(cls, (shardcore.ShardConfigError, shardcore.WrapPlanError)):
        err = cls("some_key", "is wrong.")
    else:
        err = cls("it went wrong.")
    assert str(err).startswith("shardcore"), str(err)
    assert cls.__name__ in shardcore.__all__  # users can catch each one by name


def test_an_indivisible_batch_is_one_error_class():
    from shardcore.distributed import check_batch_divides

    check_batch_divides({"x": torch.zeros(6, 2)}, 3, "ranks")
    with pytest.raises(shardcore.BatchError, match=r"batch field 'y' has 5 rows, not divisible by the 2 devices"):
        check_batch_divides({"x": torch.zeros(4, 2), "y": torch.zeros(5)}, 2, "devices")
