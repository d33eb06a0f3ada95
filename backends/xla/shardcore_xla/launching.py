"""Starting the ranks of an XLA run (shardcore-conformance and :func:`shardcore.launch`): one process
for every device under SPMD; under XLA FSDP one device per process or, on CPU, per thread of one
process (``xmp.spawn``), with the CPU recipe's environment (cpu.py) set before the runtime starts.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from shardcore.capabilities import LaunchSpec
from shardcore.errors import DistributedSetupError

from . import cpu

log = logging.getLogger(__name__)


def _device_env(world_size: int) -> dict[str, str]:
    device = os.environ.get("PJRT_DEVICE", "CPU" if not has_tpu() else "TPU")
    return {"PJRT_DEVICE": device, **({"CPU_NUM_DEVICES": str(world_size)} if device == "CPU" else {})}


def spmd_launch_spec(world_size: int) -> LaunchSpec:
    """One process drives every device."""
    return LaunchSpec(processes=1, env=_device_env(world_size), group="spmd")


def fsdp_launch_spec(world_size: int) -> LaunchSpec:
    """One process whose devices ``run_on_devices`` serves, with the CPU recipe on several CPU devices."""
    env = _device_env(world_size)
    if env["PJRT_DEVICE"] == "CPU" and world_size > 1:
        env.update(cpu.recipe_env(world_size))
    return LaunchSpec(processes=1, env=env, group="fsdp", per_device=world_size > 1)


def run_on_devices(fn: Callable[[int], None]) -> None:
    """Run ``fn(ordinal)`` once per device (``xmp.spawn``). On CPU it first sets the runtime
    environment XLA FSDP needs on several devices (see cpu.py), which the spawned process inherits."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
        cpu.prepare(int(os.environ.get("CPU_NUM_DEVICES", "1")))
    xmp.spawn(_call_with_ordinal, args=(fn,))


def without_ordinal(fn: Callable[[], None], ordinal: int) -> None:
    fn()


def _call_with_ordinal(index: int, fn: Callable[[int], None]) -> None:
    import torch_xla.runtime as xr

    try:
        fn(xr.global_ordinal())
    except BaseException as e:
        if not isinstance(e, DistributedSetupError) or not cpu.aborted():
            # the cause: xmp.spawn re-raises whichever thread's error it collects first, often
            # another device's "stop waiting" that follows from this one
            log.error("shardcore xla: device %d failed", xr.global_ordinal(), exc_info=True)
        # the other device threads would wait for this one at the next step end until the timeout
        cpu.abort_all()
        raise


def has_tpu() -> bool:
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
