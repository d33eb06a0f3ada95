"""What ``shardcore plan`` adds on CUDA that no op of a fake step shows (shardcore.workspaces): the BLAS
workspaces (the sizes torch picks, which threads of a step hold one, added only where modelled) and
the temporaries CUDA kernels take inside an op."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardcore import planning, workspaces
from shardcore.errors import ShardcoreError
from shardcore.workspaces import DeviceKernels, GemmThreads, cublas_workspace_bytes, cublaslt_workspace_bytes

MiB = 2**20


def test_cublas_sizes_follow_the_device_and_the_environment():
    assert cublas_workspace_bytes((9, 0), {}) == 32 * MiB  # H100 / H200
    for other in ((8, 0), (8, 9), (9, 1), (10, 0)):  # torch 2.9-2.11 test exactly major 9, minor 0
        assert cublas_workspace_bytes(other, {}) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8 * MiB + 128 * 1024
    with pytest.raises(ShardcoreError, match="CUBLAS_WORKSPACE_CONFIG='4096'.*':4096:8'"):
        cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "4096"})


def test_cublaslt_has_its_own_workspace_unless_unified():
    assert cublaslt_workspace_bytes((9, 0), {}) == MiB
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    assert cublaslt_workspace_bytes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
    # capped at the cuBLAS workspace
    assert cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == 32 * MiB
    with pytest.raises(ShardcoreError, match="CUBLASLT_WORKSPACE_SIZE='1MiB' is not a size in KiB"):
        cublaslt_workspace_bytes((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "1MiB"})


def test_the_h200_gpt2_gap_is_two_cublas_and_one_cublaslt_workspace():
    """GPT-2 on the H200 (bench/results/plan_accuracy_cuda.json): forward and backward each ran
    cuBLAS GEMMs, the forward's Conv1D addmm also cuBLASLt; the measured peak was 65.00 MiB above the
    tracker's."""
    threads = GemmThreads(cublas={"forward", "backward"}, cublaslt={"forward"})
    assert workspaces.workspace_bytes(threads, (9, 0), {}) == 65 * MiB


def _record(model: nn.Module, x: torch.Tensor, ac: bool = False) -> GemmThreads:
    rec = DeviceKernels()
    with rec:
        out = checkpoint(model, x, use_reentrant=False) if ac else model(x)
        out.sum().backward()
    return rec.threads


def test_recorder_places_gemms_by_forward_and_backward():
    x = torch.randn(4, 8, requires_grad=True)
    biased = _record(nn.Linear(8, 8), x)
    assert biased.cublas == {"forward", "backward"} and biased.cublaslt == {"forward"}
    plain = _record(nn.Linear(8, 8, bias=False), x)
    assert plain.cublas == {"forward", "backward"} and plain.cublaslt == set()
    # activation checkpointing's recomputation runs the first layer's biased GEMM again, in backward
    recomputed = _record(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False)), x, ac=True)
    assert recomputed.cublaslt == {"forward", "backward"}
    none = _record(nn.ReLU(), x)
    assert none.cublas == set() and none.cublaslt == set()


def _plan(device: str) -> planning.Plan:
    return planning.Plan(
        backend="fsdp2",
        world_size=1,
        dp_replicate_size=1,
        dp_shard_size=1,
        batch_size=1,
        seq_len=8,
        optimizer="adamw",
        device=device,
        config={},
        peak_bytes=100,
        first_step_peak_bytes=90,
        breakdown={"activations": 100},
        first_step_breakdown={"activations": 90},
    )


def test_the_plan_adds_workspaces_on_cuda_only_where_modelled(monkeypatch):
    threads = GemmThreads(cublas={"forward", "backward"}, cublaslt=set())
    for var in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    plan = _plan("cuda")
    planning._add_workspaces(plan, threads)
    assert plan.breakdown["blas_workspaces"] == 64 * MiB and plan.peak_bytes == 100 + 64 * MiB
    assert plan.first_step_peak_bytes == 90 + 64 * MiB and not plan.not_predicted

    # a torch whose rules were not read, another accelerator, ROCm: said, not guessed
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    plan = _plan("cuda")
    planning._add_workspaces(plan, threads)
    assert plan.peak_bytes == 100 and "torch 2.13.0+cu130 are not modelled" in plan.not_predicted["blas_workspaces"]
    plan = _plan("xpu")
    planning._add_workspaces(plan, threads)
    assert (
        "xpu BLAS library's workspaces and kernels' own temporaries are not modelled"
        in plan.not_predicted["blas_workspaces"]
    )
    monkeypatch.setattr(torch, "__version__", "2.11.0+rocm6.4")
    monkeypatch.setattr(torch.version, "hip", "6.4")
    plan = _plan("cuda")
    planning._add_workspaces(plan, threads)
    assert "hipBLAS" in plan.not_predicted["blas_workspaces"] and plan.peak_bytes == 100
    # the CPU's peak has no such part, and nothing to say about it
    plan = _plan("cpu")
    planning._add_workspaces(plan, threads)
    assert plan.peak_bytes == 100 and "blas_workspaces" not in plan.breakdown and not plan.not_predicted


def _softmax_step_peak(kernels: DeviceKernels | None) -> tuple[int, int]:
    """The tracked peak of a softmax's forward and backward, and the bytes of its gradient."""
    from torch.distributed._tools.mem_tracker import MemTracker

    x = torch.randn(4, 8, 64, 64, requires_grad=True)
    tracker = MemTracker()
    with tracker, kernels or contextlib.nullcontext():
        torch.softmax(x, -1).sum().backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], x.numel() * 4


def test_kernel_scratch_is_held_while_its_op_runs_and_counted_by_the_tracker():
    """CUDA's softmax backward holds grad * output while it runs. The CPU stands in for the device
    here (its kernels take no such temporary, so the CUDA rule is lent to it): the tracked peak rises
    by exactly the gradient's bytes with the rule, and not at all without it, or for tensors on
    another device."""
    base, grad = _softmax_step_peak(None)
    assert _softmax_step_peak(DeviceKernels("cpu")) == (base, grad)  # the CPU has no rule of its own
    cuda = workspaces.KERNEL_SCRATCH["cuda"]
    assert _softmax_step_peak(DeviceKernels("cpu", cuda)) == (base + grad, grad)
    assert _softmax_step_peak(DeviceKernels("cpu", {})) == (base, grad)
    assert _softmax_step_peak(DeviceKernels("cuda", cuda)) == (base, grad)  # the tensors are not on its device


def test_softmax_backward_scratch_makes_the_cpu_stand_in_of_the_h200_step_exact():
    """The H200's Llama step (bench/results/plan_accuracy_cuda.json: fp32, 1 device, 8 x 512, grouped
    KV heads, so math attention) peaked 100.00 MiB above the plan: two 32 MiB cuBLAS workspaces and
    36 MiB that was the softmax backward's temporary, a second (8, 8, 512, 512) score matrix that moves
    the peak into attention's backward. Planned on this CPU with the same attention kernel, CUDA's
    kernel rule lent to the CPU and the workspaces of the threads that ran GEMMs, the plan meets the
    measured peak within 0.01%, first step included (0.88 before either part)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import plan_accuracy

    (row,) = plan_accuracy.cuda_standin({"llama-dev1"})
    assert abs(row["ratio"] - 1) < 1e-4 and abs(row["first_step_ratio"] - 1) < 1e-4, row
    assert row["predicted_breakdown"]["blas_workspaces"] == 64 * MiB
    # the peak is in attention's backward: three score matrices and the temporary, all "Temp"
    assert row["predicted_breakdown"]["temporaries"] > 3 * 64 * MiB
    assert "cpu" not in workspaces.KERNEL_SCRATCH  # the rule was lent for the plan only


def test_the_stand_in_takes_the_recorded_gpus_capability_and_refuses_without_one(tmp_path, monkeypatch):
    """The workspace size depends on the GPU, so the stand-in reads the record's compute capability
    (or, for the H200 record made before the bench wrote it, the known one) and never assumes it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import plan_accuracy

    record = json.loads((plan_accuracy.RESULTS / "plan_accuracy_cuda.json").read_text())
    record["machine"].update(accelerator_name="NVIDIA A100-SXM4-80GB", accelerator_capability=[8, 0])
    (tmp_path / "plan_accuracy_cuda.json").write_text(json.dumps(record))
    monkeypatch.setattr(plan_accuracy, "RESULTS", tmp_path)
    (row,) = plan_accuracy.cuda_standin({"llama-dev1"})
    assert row["predicted_breakdown"]["blas_workspaces"] == 2 * (8 * MiB + 128 * 1024)  # not the H200's 2 x 32
    del record["machine"]["accelerator_capability"]
    (tmp_path / "plan_accuracy_cuda.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="'NVIDIA A100-SXM4-80GB' without its compute capability"):
        plan_accuracy.cuda_standin({"llama-dev1"})
