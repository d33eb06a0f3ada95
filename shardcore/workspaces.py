"""Device memory that no tensor op shows: the BLAS library's workspaces, for ``shardcore plan``.

cuBLAS keeps a workspace per (handle, stream), and torch gives each thread its own handle. The
workspace is taken from the CUDA caching allocator at a thread's first GEMM, as a raw block and not a
tensor, and held for the life of the process: ``torch.cuda.max_memory_allocated`` counts it, a
dispatch-level tracker never sees it. In a training step the forward runs on the calling thread and
the backward (activation checkpointing's recomputation included) on the autograd engine's thread for
the device, so a step holds two. A GEMM with a bias (``addmm`` with a 1-D ``self``: ``nn.Linear`` with
a bias, GPT-2's ``Conv1D``) goes through cuBLASLt, which has a workspace of its own per thread.

The sizes are those torch 2.9 to 2.11 choose (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
``parseChosenWorkspaceSize`` and ``parseCUDABlasLtWorkspaceSize``, read in the 2.11.0+cu130 binary):
cuBLAS 32 MiB on compute capability 9.0 and 8 MiB + 128 KiB on any other, or the sum of
``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KiB:COUNT`` groups; cuBLASLt ``CUBLASLT_WORKSPACE_SIZE`` KiB
(default 1024), none of its own under ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``. Other torch versions
and other accelerators' libraries are not modelled, and the plan says so.

Measured on an H200 with torch 2.11 (``bench/results/plan_accuracy_cuda.json``): GPT-2's peak was
65.00 MiB above the tracker's, two cuBLAS workspaces and one cuBLASLt workspace.

A kernel's own temporaries: under fake tensors an op runs its meta kernel, which makes the outputs
and nothing else, so a temporary that the device kernel allocates for the op's duration is missing
from the plan. :data:`KERNEL_SCRATCH` lists the ones found; :class:`DeviceKernels` makes each one,
by the same aten op the kernel calls, around the op it belongs to, so the tracker counts it at the
moment the real kernel holds it. CUDA's softmax backward is one (``softmax_backward_cuda_out`` in
``aten/src/ATen/native/cuda/SoftMax.cu``: ``Tensor tmp = grad * output;``, a call of ``aten::mul`` in
the 2.9, 2.10 and 2.11 binaries): math attention's backward holds a second copy of its score matrix
there. With it, the plan of the H200's Llama step (fp32, grouped KV heads: math attention) is 781.52
MiB before workspaces, as measured to 3 KB; without it 745.51.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ShardcoreError

#: the torch versions whose workspace rules were read (major, minor), lowest and highest
MODELLED_TORCH = ((2, 9), (2, 11))
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_addmm_activation"}


def cublas_workspace_bytes(capability: tuple[int, int], env: Mapping[str, str]) -> int:
    """One cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` where set, else torch's default for the
    device's compute capability."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        groups = re.findall(r":(\d+):(\d+)", config)
        if not groups:
            raise ShardcoreError(
                f"shardcore plan: CUBLAS_WORKSPACE_CONFIG={config!r} has no ':SIZE_KiB:COUNT' group; cuBLAS "
                "reads e.g. ':4096:8' (8 buffers of 4 MiB). Fix or unset it."
            )
        return sum(int(size) * 1024 * int(count) for size, count in groups)
    return 4096 * 8 * 1024 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace_bytes(capability: tuple[int, int], env: Mapping[str, str]) -> int:
    """The cuBLASLt workspace a thread holds besides its cuBLAS one (0 when the two are unified)."""
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1":
        return 0
    kib = env.get("CUBLASLT_WORKSPACE_SIZE", "1024")
    if not kib.isdigit():
        raise ShardcoreError(
            f"shardcore plan: CUBLASLT_WORKSPACE_SIZE={kib!r} is not a size in KiB; cuBLASLt reads a whole "
            "number, e.g. 1024. Fix or unset it."
        )
    return min(int(kib) * 1024, cublas_workspace_bytes(capability, env))


@dataclass
class GemmThreads:
    """Which of a step's threads run GEMMs, as the real run places them: ``forward`` (the calling
    thread) and ``backward`` (the autograd engine's device thread); per thread, whether any GEMM went
    through cuBLASLt."""

    cublas: set[str] = field(default_factory=set)
    cublaslt: set[str] = field(default_factory=set)


def _softmax_backward_tmp(grad: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: Any) -> torch.Tensor:
    # SoftMax.cu, softmax_backward_cuda_out: `Tensor tmp = grad * output;`, then the kernel reads it
    return torch.ops.aten.mul.Tensor(grad, output)


#: per device type: the ops whose kernel holds a temporary from the allocator while the op runs (its
#: output already allocated), and how to make the same temporary from the op's arguments. Read in the
#: torch 2.9-2.11 CUDA binaries; applied where :func:`modelled` says so.
KERNEL_SCRATCH: dict[str, dict[Any, Any]] = {
    "cuda": {torch.ops.aten._softmax_backward_data.default: _softmax_backward_tmp},
}


class DeviceKernels(TorchDispatchMode):
    """What a planned step's device kernels would do beyond their outputs. Records each GEMM under the
    thread it runs on in a real run: the plan runs backward on the calling thread (see ``planning``),
    so whether an op belongs to backward is read from the autograd engine (a graph task is running),
    not from the thread. Makes each temporary of ``scratch`` (op -> maker; by default the device's
    own rules where :func:`modelled`) around its op, for tensors on ``device``. Entered after the
    memory tracker: it sees each op first, and what it makes dispatches through the tracker, which
    counts it."""

    def __init__(self, device: str = "cuda", scratch: Mapping[Any, Any] | None = None) -> None:
        super().__init__()
        self.device = device
        self.threads = GemmThreads()
        if scratch is None:
            scratch = KERNEL_SCRATCH.get(device, {}) if modelled(device) is None else {}
        self.scratch = scratch

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _GEMMS:
            where = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
            # torch routes addmm (and its fused-activation form) with a 1-D bias and beta 1 to
            # cuBLASLt's gemm_and_bias
            lt = name in ("addmm", "_addmm_activation") and args[0].dim() == 1 and kwargs.get("beta", 1) == 1
            self.threads.cublas.add(where)
            if lt:
                self.threads.cublaslt.add(where)
        make = self.scratch.get(func)
        if make is None or args[0].device.type != self.device:
            return func(*args, **kwargs)
        tmp = make(*args, **kwargs)  # held while the op runs, freed when it returns, as the kernel does
        out = func(*args, **kwargs)
        del tmp
        return out


def modelled(device: str) -> str | None:
    """None where this torch's workspaces and kernel temporaries on ``device`` are modelled, else why
    not."""
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if device != "cuda":
        return (
            f"the {device} BLAS library's workspaces and kernels' own temporaries are not modelled (only "
            "cuBLAS's and CUDA's, torch 2.9-2.11)"
        )
    if torch.version.hip:
        return (
            "hipBLAS/hipBLASLt workspaces and HIP kernels' own temporaries are not modelled (only cuBLAS's and "
            "CUDA's, torch 2.9-2.11)"
        )
    if not MODELLED_TORCH[0] <= version <= MODELLED_TORCH[1]:
        return (
            f"cuBLAS workspace sizes and CUDA kernels' own temporaries of torch {torch.__version__} are not "
            "modelled (read for torch 2.9-2.11)"
        )
    return None


def workspace_bytes(threads: GemmThreads, capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """What the step's threads hold in BLAS workspaces, from their first GEMM on."""
    env = os.environ if env is None else env
    return len(threads.cublas) * cublas_workspace_bytes(capability, env) + len(
        threads.cublaslt
    ) * cublaslt_workspace_bytes(capability, env)
