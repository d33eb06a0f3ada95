"""Which device a ``torch.distributed`` backend runs on, and the process-group backend for it.

The device is what ``torch.accelerator`` reports (CUDA, ROCm, XPU, MPS, HPU, an out-of-tree
PrivateUse1 device), one per rank, indexed by ``LOCAL_RANK``. Its process-group backend is the one
torch registers for that device type (``torch.distributed.get_default_backend_for_device``: nccl for
cuda, xccl for xpu, whatever ``Backend.register_backend(..., devices=[...])`` added), with gloo
beside it for CPU tensors (offloaded state, metadata).

Running on the CPU is never a silent fallback: an accelerator that torch reports but that has no
usable distributed backend is a :class:`~shardcore.errors.DistributedSetupError`. The CPU is chosen
explicitly, with ``use_cpu: true`` in the config (as in ``TrainingArguments`` and an accelerate
YAML) or ``SHARDCORE_DEVICE=cpu`` in the environment. ``SHARDCORE_DEVICE=<type>`` requires that
accelerator and fails where torch reports another; ``auto`` (the default) takes what torch reports.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .errors import DistributedSetupError

#: the environment's choice of device type: ``auto`` (default), ``cpu``, or an accelerator type
DEVICE_ENV = "SHARDCORE_DEVICE"

#: what each device type's distributed backend comes from, for the error when torch has none
_INSTALL_HINTS = {
    "xpu": "a torch build with XCCL (the Intel XPU wheels of torch >= 2.8)",
    "hpu": "habana_frameworks.torch (its import registers hccl)",
    "npu": "torch_npu (its import registers hccl)",
    "mps": "a torch build with gloo",
}

#: the device type each process group was made for (the default group's is the one that counts)
_chosen: str | None = None


def accelerator() -> str | None:
    """The accelerator type torch reports here (``cuda``, ``xpu``, ``mps``, ...), None without one."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    device = acc.current_accelerator()
    return device.type if device is not None else None


def requested(use_cpu: bool = False) -> str:
    """The device type asked for: ``cpu`` when ``use_cpu`` or ``SHARDCORE_DEVICE=cpu``; else the
    accelerator torch reports (the CPU where there is none); ``SHARDCORE_DEVICE=<type>`` must be that
    accelerator."""
    want = os.environ.get(DEVICE_ENV, "auto").strip().lower() or "auto"
    if use_cpu or want == "cpu":
        return "cpu"
    have = accelerator()
    if want == "auto":
        return have or "cpu"
    if have != want:
        raise DistributedSetupError(
            f"shardcore: {DEVICE_ENV}={want} but torch reports "
            + (f"the accelerator {have!r}" if have else "no accelerator")
            + f" (torch.accelerator.current_accelerator()). Install {want}'s torch support, set "
            f"{DEVICE_ENV}=auto to use what torch reports, or {DEVICE_ENV}=cpu to run on the CPU."
        )
    return want


def process_group_backend(device_type: str) -> str:
    """The ``init_process_group`` backend for ``device_type``: gloo for the CPU, else
    ``cpu:gloo,<type>:<its backend>``. Raises DistributedSetupError when torch registers no backend
    for the device, or registers one that this torch build lacks."""
    import torch.distributed as dist

    if device_type == "cpu":
        return "gloo"
    try:
        backend = dist.get_default_backend_for_device(device_type)
    except (ValueError, RuntimeError) as e:
        raise DistributedSetupError(
            f"shardcore: torch reports the accelerator {device_type!r}, but no torch.distributed backend is "
            f"registered for it ({e}). Install {_INSTALL_HINTS.get(device_type, 'the device vendor’s torch.distributed plugin')}, "
            f"or register one with torch.distributed.Backend.register_backend(name, creator, devices=[{device_type!r}]); "
            f"to train on the CPU instead, set use_cpu: true or {DEVICE_ENV}=cpu."
        ) from None
    if not dist.is_backend_available(backend):
        raise DistributedSetupError(
            f"shardcore: torch reports the accelerator {device_type!r}, whose torch.distributed backend is "
            f"{backend!r}, but this torch build has no {backend!r}. Install "
            f"{_INSTALL_HINTS.get(device_type, 'a torch build with it')}; to train on the CPU instead, set "
            f"use_cpu: true or {DEVICE_ENV}=cpu."
        )
    if backend == "gloo":  # gloo serves the CPU and the device alike (mps)
        return "gloo"
    return f"cpu:gloo,{device_type}:{backend}"


def set_device(device_type: str, local_rank: int) -> None:
    """Make ``local_rank`` this process's current device of ``device_type`` (no-op for the CPU)."""
    if device_type == "cpu":
        return
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise DistributedSetupError(
            f"shardcore: LOCAL_RANK={local_rank} but torch sees {count} {device_type} device(s) here. Start at "
            f"most {count} ranks on this machine, or make the devices visible to every rank."
        )
    torch.accelerator.set_device_index(local_rank)


def chosen() -> str:
    """The device type of this process's ranks: the one the process group was made for; before
    that, what :func:`requested` says."""
    return _chosen if _chosen is not None else requested()


def choose(device_type: str) -> None:
    global _chosen
    _chosen = device_type


def current_device() -> torch.device:
    """This rank's device: ``cpu``, or the current index of the chosen accelerator."""
    t = chosen()
    if t == "cpu":
        return torch.device("cpu")
    return torch.device(t, torch.accelerator.current_device_index())


def describe(device: torch.device | str) -> dict[str, Any]:
    """Name, type and runtime version of ``device`` as torch reports them: what a conformance report
    certifies."""
    device = torch.device(device)
    out: dict[str, Any] = {"type": device.type, "index": device.index}
    if device.type == "cpu":
        out["name"] = cpu_name()
        return out
    module = getattr(torch, device.type, None)
    name = getattr(module, "get_device_name", None)
    try:
        out["name"] = name(device.index or 0) if name is not None else device.type
    except Exception:  # noqa: BLE001 - a vendor module without the call, or one that needs other arguments
        out["name"] = device.type
    for attr in ("cuda", "hip", "xpu"):  # the runtime torch was built against, where it says
        version = getattr(torch.version, attr, None)
        if version and (device.type == attr or (attr == "hip" and device.type == "cuda")):
            out["runtime"] = f"{attr} {version}"
    return out


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; elsewhere the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"
