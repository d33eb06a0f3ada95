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


class GemmRecorder(TorchDispatchMode):
    """Records each GEMM of a planned step under the thread it runs on in a real run. The plan runs
    backward on the calling thread (see ``planning``); whether an op belongs to backward is read from
    the autograd engine (a graph task is running), not from the thread."""

    def __init__(self) -> None:
        super().__init__()
        self.threads = GemmThreads()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name.split("::")[-1]
        if name in _GEMMS:
            where = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
            # torch routes addmm (and its fused-activation form) with a 1-D bias and beta 1 to
            # cuBLASLt's gemm_and_bias
            lt = name in ("addmm", "_addmm_activation") and args[0].dim() == 1 and (kwargs or {}).get("beta", 1) == 1
            self.threads.cublas.add(where)
            if lt:
                self.threads.cublaslt.add(where)
        return func(*args, **(kwargs or {}))


def modelled(device: str) -> str | None:
    """None where this torch's workspaces on ``device`` are modelled, else why not."""
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if device != "cuda":
        return f"the {device} BLAS library's workspaces are not modelled (only cuBLAS's, torch 2.9-2.11)"
    if torch.version.hip:
        return "hipBLAS/hipBLASLt workspaces are not modelled (only cuBLAS's, torch 2.9-2.11)"
    if not MODELLED_TORCH[0] <= version <= MODELLED_TORCH[1]:
        return f"cuBLAS workspace sizes of torch {torch.__version__} are not modelled (read for torch 2.9-2.11)"
    return None


def workspace_bytes(threads: GemmThreads, capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """What the step's threads hold in BLAS workspaces, from their first GEMM on."""
    env = os.environ if env is None else env
    return len(threads.cublas) * cublas_workspace_bytes(capability, env) + len(
        threads.cublaslt
    ) * cublaslt_workspace_bytes(capability, env)
