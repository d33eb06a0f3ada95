"""Any torch accelerator through torch.distributed backends (shardcore.devices), on this CPU machine:
stand-ins for ``torch.accelerator`` report other device types (xpu, hpu, mps, a PrivateUse1 device),
and the checks are on what shardcore decides from them: the device, the process-group backend
string, the clear error where the device has no backend, and never a silent fallback to the CPU."""

import pytest
import torch
import torch.distributed as dist

import shardcore
from shardcore import devices
from shardcore.errors import DistributedSetupError, UnsupportedKeyError


@pytest.fixture
def accelerator(monkeypatch):
    """``accelerator(type, count=2)``: torch.accelerator reports ``count`` devices of ``type``;
    returns the list of indices ``set_device_index`` was given. torch.distributed's backend
    registry is restored afterwards."""
    for attr in ("default_device_backend_map", "backend_capability", "backend_type_map", "_plugins"):
        monkeypatch.setattr(dist.Backend, attr, dict(getattr(dist.Backend, attr)))
    monkeypatch.setattr(dist.Backend, "backend_list", list(dist.Backend.backend_list))
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)
    monkeypatch.setattr(devices, "_chosen", None)

    def report(device_type: str, count: int = 2) -> list[int]:
        chosen: list[int] = []
        if device_type in ("hpu", "privateuseone"):
            # no vendor plugin here (torch 2.13's testing "fake" backend, which accelerate's import
            # registers for hpu, is not one)
            dist.Backend.default_device_backend_map.pop(device_type, None)
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(
            torch.accelerator, "current_accelerator", lambda check_available=False: torch.device(device_type)
        )
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
        monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: chosen[-1] if chosen else 0)
        return chosen

    return report


def _register(name: str, device_type: str) -> None:
    """What a vendor plugin does at import (torch_npu, habana_frameworks): a backend for its device."""
    dist.Backend.register_backend(name, lambda *a, **k: None, devices=[device_type])


@pytest.mark.parametrize("device_type", ["xpu", "hpu", "mps", "privateuseone"])
def test_the_device_is_the_accelerator_torch_reports(accelerator, device_type):
    accelerator(device_type)
    assert devices.requested() == device_type


def test_the_cpu_is_chosen_explicitly_never_by_fallback(accelerator, monkeypatch):
    accelerator("xpu")
    assert devices.requested(use_cpu=True) == "cpu"
    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    assert devices.requested() == "cpu" and devices.process_group_backend("cpu") == "gloo"
    monkeypatch.setenv(devices.DEVICE_ENV, "hpu")  # asks for another accelerator than torch reports
    with pytest.raises(DistributedSetupError, match="SHARDCORE_DEVICE=hpu but torch reports the accelerator 'xpu'"):
        devices.requested()


def test_process_group_backend_per_device_type(accelerator, monkeypatch):
    accelerator("cuda")
    assert devices.process_group_backend("mps") == "gloo"  # torch maps mps to gloo: one backend for both
    monkeypatch.setattr(dist, "is_backend_available", lambda b: True)
    assert devices.process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert devices.process_group_backend("xpu") == "cpu:gloo,xpu:xccl"


def test_a_device_whose_backend_this_torch_lacks_is_refused_by_name(accelerator):
    accelerator("xpu")
    assert not dist.is_backend_available("xccl")  # this CPU build of torch has no XCCL
    with pytest.raises(DistributedSetupError) as e:
        devices.process_group_backend("xpu")
    msg = str(e.value)
    assert "accelerator 'xpu'" in msg and "'xccl'" in msg and "use_cpu: true or SHARDCORE_DEVICE=cpu" in msg


@pytest.mark.parametrize("device_type, plugin", [("hpu", "hccl"), ("privateuseone", "fakeccl")])
def test_an_unregistered_device_is_refused_and_a_registered_one_is_used(accelerator, device_type, plugin):
    accelerator(device_type)
    with pytest.raises(DistributedSetupError) as e:
        devices.process_group_backend(device_type)
    msg = str(e.value)
    assert f"accelerator {device_type!r}, but no torch.distributed backend is registered for it" in msg
    assert f"register_backend(name, creator, devices=[{device_type!r}])" in msg
    _register(plugin, device_type)
    assert devices.process_group_backend(device_type) == f"cpu:gloo,{device_type}:{plugin}"


def test_the_process_group_is_made_for_the_device_of_local_rank(accelerator, monkeypatch):
    """ensure_process_group: LOCAL_RANK's device made current, the device's backend beside gloo."""
    from shardcore.distributed import ensure_process_group

    chosen = accelerator("privateuseone", count=2)
    _register("fakeccl", "privateuseone")
    calls = []

    def init(backend, **kwargs):
        calls.append(backend)
        raise RuntimeError("stand-in: no fakeccl peers")

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    for k, v in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedSetupError, match="could not join the process group as rank 1 of 2"):
        ensure_process_group(5, devices.requested())
    assert calls == ["cpu:gloo,privateuseone:fakeccl"] and chosen == [1]
    assert devices.current_device() == torch.device("privateuseone", 1)

    monkeypatch.setenv("LOCAL_RANK", "2")  # more ranks on this machine than devices
    with pytest.raises(DistributedSetupError, match="LOCAL_RANK=2 but torch sees 2 privateuseone device"):
        ensure_process_group(5, devices.requested())


def test_shard_on_an_accelerator_without_its_backend_says_so_instead_of_training_on_the_cpu(
    accelerator, monkeypatch, tiny_llama
):
    """The reported bug: torch.accelerator said xpu, CUDA was absent, and shard() returned a model on
    the CPU without a word. Now it refuses, naming the device and the missing backend."""
    accelerator("xpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(DistributedSetupError, match="accelerator 'xpu', whose torch.distributed backend is 'xccl'"):
        shardcore.shard(tiny_llama, {})


def test_use_cpu_trains_on_the_cpu_where_an_accelerator_is_reported(accelerator, tiny_llama):
    accelerator("xpu")
    model = shardcore.shard(tiny_llama, {"use_cpu": True})
    assert shardcore.handle(model).backend.world().device.type == "cpu"
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_use_cpu_after_a_model_on_the_accelerator_gets_a_cpu_mesh(tiny_llama):
    """On a GPU the conformance suite's use_cpu case trained on the GPU: the process's first model
    had built a CUDA mesh, and the backend reused it (same group, same shape) for the use_cpu model,
    so fully_shard moved its parameters to the GPU. The mesh now follows the device type."""
    import copy

    backend = shardcore.get_backend("fsdp2")
    shardcore.shard(copy.deepcopy(tiny_llama), {})
    cached = backend._mesh

    class AcceleratorMesh:  # the mesh as the first model left it on a GPU machine
        device_type = "cuda"

        def __getattr__(self, name):
            return getattr(cached, name)

    backend._mesh = AcceleratorMesh()
    model = shardcore.shard(tiny_llama, {"use_cpu": True})
    assert backend._mesh.device_type == "cpu" and {p.device.type for p in model.parameters()} == {"cpu"}


def test_use_cpu_comes_from_every_source(tmp_path):
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text("distributed_type: FSDP\nuse_cpu: true\nfsdp_config:\n  fsdp_version: 2\n")
    assert shardcore.parse_config(str(yaml)).use_cpu
    assert shardcore.parse_config({"use_cpu": "true"}).use_cpu
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert shardcore.parse_config(args).use_cpu


@pytest.mark.xla
def test_xla_refuses_use_cpu_and_says_how_to_run_on_the_cpu():
    with pytest.raises(UnsupportedKeyError, match="PJRT_DEVICE=CPU"):
        shardcore.shard(torch.nn.Linear(2, 2), {"xla": True, "use_cpu": True})


# ----------------------------------------------------------------- what the conformance suite certifies


def _placement(requested, devices=2, **rank):
    base = {"batch": ["cpu"], "loss": "cpu", "params": ["cpu"], "grads": ["cpu"]}
    return {"requested": requested, "devices": devices, "ranks": [{**base, **rank}]}


def test_a_case_fails_where_its_tensors_lived_elsewhere_than_requested():
    from shardcore_conformance.hardware import placement_problems

    cfg = shardcore.parse_config
    xpu = {"batch": ["xpu"], "loss": "xpu", "params": ["xpu"], "grads": ["xpu"]}
    assert placement_problems(_placement("xpu", **xpu), cfg({}), spmd=False) == []
    # a backend that leaves the parameters (and so their gradients) on the CPU
    (msg,) = placement_problems(_placement("xpu", **{**xpu, "params": ["cpu"], "grads": ["cpu"]}), cfg({}), False)
    assert msg == (
        "ran on another device than requested: rank 0's parameters on cpu, expected xpu; gradients on cpu, expected xpu"
    )
    # cpu_offload keeps the state on the CPU, and only the state; use_cpu runs the whole case there
    offloaded = _placement("xpu", **{**xpu, "params": ["cpu"], "grads": ["cpu"]})
    assert placement_problems(offloaded, cfg({"cpu_offload": True}), False) == []
    (msg,) = placement_problems(_placement("xpu", **{**xpu, "params": ["xpu"]}), cfg({"cpu_offload": True}), False)
    assert "parameters on xpu, expected cpu" in msg and "cpu_offload keeps" in msg
    assert placement_problems(_placement("xpu"), cfg({"use_cpu": True}), False) == []


def test_spmd_batches_must_be_split_over_every_device():
    from shardcore_conformance.hardware import placement_problems

    cfg = shardcore.parse_config({"xla": True, "xla_fsdp_v2": True})
    xla = {"batch": ["xla"], "loss": "xla", "params": ["xla"], "grads": ["xla"]}
    split = _placement("xla", 4, **xla, batch_sharding=["{devices=[4,1]0,1,2,3}"])
    assert placement_problems(split, cfg, spmd=True) == []
    for spec in ("{replicated}", "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}", ""):
        (msg,) = placement_problems(_placement("xla", 4, **xla, batch_sharding=[spec]), cfg, spmd=True)
        assert msg.startswith("the batch is not split over the 4 devices"), msg


def test_the_cli_refuses_a_device_type_torch_does_not_report(capsys):
    from shardcore_conformance.cli import main

    assert main(["--device-type", "xpu", "--cases", "mlp-timeout"]) == 2
    assert "--device-type xpu, but torch reports no accelerator" in capsys.readouterr().err
    assert main(["--device-type", "warp-drive", "--cases", "mlp-timeout"]) == 2
    assert "'warp-drive' is no torch device type" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_run_certifying_an_accelerator_fails_every_case_that_trained_on_the_cpu():
    """The suite told to certify ``xpu`` while the backend trains on the CPU (as FSDP2 did before:
    an accelerator it did not know became the CPU): each case fails and says where it ran, except
    the use_cpu case, whose place is the CPU."""
    from shardcore_conformance import run_suite
    from shardcore_conformance.cases import matrix_for, select
    from shardcore_conformance.hardware import DEVICE_ENV

    cases = select(matrix_for("fsdp2", 2), "llama-transformer-reshard1-ac0,llama-use_cpu")
    result = run_suite(cases, "fsdp2", 2, device_type="cpu", env={DEVICE_ENV: "xpu"}, plots=False)
    trained, use_cpu = result.verdicts
    assert trained.reasons == [
        "ran on another device than requested: rank 0's batch on cpu, expected xpu; loss on cpu, expected xpu; "
        "parameters on cpu, expected xpu; gradients on cpu, expected xpu"
    ]
    assert use_cpu.ok, use_cpu.reasons


def test_the_benchmarks_run_on_the_accelerator_torch_reports(accelerator, monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import _common
    import gpu

    chosen = accelerator("xpu")
    assert _common.device_type() == "xpu" and _common.rank_device(1) == torch.device("xpu", 1) and chosen == [1]
    assert gpu.peak_tflops("AMD Instinct MI300X") == 1307.4 and gpu.peak_tflops("Intel Data Center GPU Max") is None
    assert "gpu" in sys.modules
