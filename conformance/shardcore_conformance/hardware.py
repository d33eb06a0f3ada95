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
            for spec in p.get("batch_sharding", []):
                tiles = _TILES.search(spec)
                dims = [int(d) for d in tiles.group(1).split(",")] if tiles else []
                if not dims or dims[0] != n or "last_tile_dim_replicate" in spec:
                    problems.append(
                        f"the batch is not split over the {n} devices: its sharding is {spec or 'none'}, expected dim 0 "
                        f"over all {n} (xla_fsdp_v2 is set: SPMD splits one global batch; every device computing "
                        f"the same rows trains right, {n}x slower)"
                    )
                    break
        if problems:
            return problems[:1]
    return problems
