"""What a conformance run certifies: the device type it was asked for, what each rank ran on, and
the check that every case's parameters, gradients and batches lived there.

The device type comes from ``--device-type`` (``auto``: the accelerator ``torch.accelerator``
reports, the CPU where there is none; the XLA backend: ``xla``), and reaches every worker in
:data:`DEVICE_ENV`. The backend under test hears it through ``SHARDCORE_DEVICE`` (shardcore's own
setting, :mod:`shardcore.devices`), so a backend that ignores it and trains elsewhere fails the
case: a certificate never names hardware that did not run.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

#: the device type a run certifies, as each worker reads it
DEVICE_ENV = "SHARDCORE_CONFORMANCE_DEVICE"


def resolve(device_type: str | None, backend: str) -> str:
    """``auto`` (or None) made concrete: ``xla`` for a backend that runs on XLA devices, else the
    accelerator torch reports, else ``cpu``."""
    if device_type not in (None, "auto"):
        return device_type
    if _is_xla(backend):
        return "xla"
    from shardcore.devices import accelerator

    return accelerator() or "cpu"


def _is_xla(backend: str) -> bool:
    import shardcore

    try:
        b = shardcore.get_backend(backend)
    except Exception:  # noqa: BLE001 - an unloadable backend fails later with its own error
        return False
    return getattr(b, "device_type", None) == "xla"


def hardware(device: torch.device) -> dict[str, Any]:
    """Type, name and runtime of a rank's device (XLA: the PJRT device behind it)."""
    if device.type != "xla":
        from shardcore.devices import describe

        return describe(device)
    import torch_xla
    import torch_xla.runtime as xr

    kind = xr.device_type()
    out: dict[str, Any] = {"type": "xla", "index": device.index, "pjrt_device": os.environ.get("PJRT_DEVICE", kind)}
    if kind == "CPU":
        from shardcore.devices import cpu_name

        out["name"] = f"XLA:CPU ({cpu_name()})"
    elif kind == "TPU":
        try:
            out["name"] = f"TPU v{torch_xla.tpu.version()}"
        except Exception:  # noqa: BLE001 - a runtime without the TPU metadata
            out["name"] = "TPU"
    else:
        out["name"] = f"XLA:{kind}"
    out["runtime"] = f"torch_xla {torch_xla.__version__}"
    return out


def versions() -> dict[str, str]:
    """The software the verdict was reached with, from the installed packages' metadata (importing
    torch_xla would start its runtime in a run that does not use it)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "torch_xla", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


_TILES = re.compile(r"devices=\[([\d,]+)\]")


def _spmd_batch_problem(specs: list[str], n: int, tp: int) -> str | None:
    """Under SPMD one global batch is split along dim 0 over the data-parallel devices, ``n / tp`` of
    them, and each split is replicated over the ``tp`` devices of one tensor-parallel group."""
    dp = n // tp
    for spec in specs:
        tiles = _TILES.search(spec)
        dims = [int(d) for d in tiles.group(1).split(",")] if tiles else []
        replicated = "last_tile_dim_replicate" in spec
        if tp == 1:
            ok = bool(dims) and dims[0] == n and not replicated
        elif dp == 1:
            ok = spec == "{replicated}" or (bool(dims) and dims[0] == 1 and replicated)
        else:
            ok = bool(dims) and dims[0] == dp and replicated and dims[-1] == tp
        if not ok:
            if tp == 1:
                want = f"dim 0 over all {n}"
            elif dp == 1:
                want = f"replicated over the {tp} devices of the one tensor-parallel group"
            else:
                want = f"dim 0 over the {dp} data-parallel groups, replicated over the {tp} devices of each"
            if tp == 1:
                what = f"not split over the {n} devices"
                why = f"SPMD splits one global batch; every device computing the same rows trains right, {n}x slower"
            else:
                what = f"not split as {dp} data-parallel x {tp} tensor devices need"
                why = f"tp_size is {tp}: the devices of one tensor group compute the same rows with their slices of the weights"
            return f"the batch is {what}: its sharding is {spec or 'none'}, expected {want} (xla_fsdp_v2 is set: {why})"
    return None


def placement_problems(placement: dict[str, Any], config: Any, spmd: bool) -> list[str]:
    """Where a case's tensors lived on each rank against the device type requested:

    - the batch and the loss on that device type (the forward ran there);
    - parameters and gradients there too, except under ``cpu_offload`` (the CPU holds them) and
      ``use_cpu`` (the whole case runs on the CPU);
    - under SPMD on several devices, every batch tensor split along dim 0 over every device (a batch
      replicated, or split over some axes only, trains right and wastes the others)."""
    want = "cpu" if config.use_cpu else placement.get("requested")
    if not want:
        return []
    state = "cpu" if config.cpu_offload or config.use_cpu else want
    problems = []
    for rank, p in enumerate(placement["ranks"]):
        wrong = []
        for what, key, expected in (
            ("batch", "batch", want),
            ("loss", "loss", want),
            ("parameters", "params", state),
            ("gradients", "grads", state),
        ):
            got = p.get(key)
            got = [got] if isinstance(got, str) else got
            if got and set(got) != {expected}:
                wrong.append(f"{what} on {'+'.join(got)}, expected {expected}")
        if wrong:
            why = (
                " (cpu_offload keeps parameters and gradients on the CPU)"
                if config.cpu_offload and want != "cpu"
                else ""
            )
            problems.append(f"ran on another device than requested: rank {rank}'s " + "; ".join(wrong) + why)
        n = placement.get("devices", 1)
        if spmd and n > 1:
            problem = _spmd_batch_problem(p.get("batch_sharding", []), n, getattr(config, "tp_size", 1))
            if problem:
                problems.append(problem)
        if problems:
            return problems[:1]
    return problems
