"""Starting the ranks of an XLA run (shardcore-conformance and :func:`shardcore.launch`): one process
for every device under SPMD; under XLA FSDP one device per process (``xmp.spawn``) or, on CPU, one
thread per device in the calling process, with the CPU recipe's environment (cpu.py) set before the
runtime starts. Every launch holds the variables that upstream code toggles steady while it runs
(:func:`steady_environment`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
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
    """Run ``fn(ordinal)`` once per device, as ``xmp.spawn`` does.

    On CPU it first sets the runtime environment XLA FSDP needs on several devices (see cpu.py), and
    runs the device threads in this process. ``xmp.spawn`` would start one process for them, whose
    only job is to call torch_xla's thread-per-device runner with the same environment: a second
    interpreter that imports torch, torch_xla and the caller's modules again (6 to 8 s on a 2-core
    machine) and must unpickle ``fn``. Unlike ``xmp.spawn`` it may run again in the same process.
    Elsewhere (TPU, plug-in devices: one process per chip) it is ``xmp.spawn``."""
    if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
        devices = int(os.environ.get("CPU_NUM_DEVICES", "1"))
        cpu.prepare(devices)
        threads = _thread_runner()
        if threads is not None:
            if devices > 1 and cpu.runtime_initialized():
                # started by an earlier launch in this process (which may launch again), or by the
                # user: either way it must have the recipe, or the devices deadlock
                cpu.check(devices)
            with steady_environment():
                threads(_call_with_ordinal, (fn,))
            return
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_call_with_ordinal, args=(fn,))


#: variables upstream code sets and removes again inside a run, each with the value its setter writes
#: or one its readers take as unset: torch_xla's ``jax_env_context`` around every device-loader batch,
#: accelerate's ``is_cuda_available`` in each ``TrainingArguments`` and ``Accelerator``,
#: ``TrainingArguments`` with ``fsdp`` set
TOGGLED_ENV = {
    "SKIP_MEGASCALE_PJRT_CLIENT": "true",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
}


_STEADY_LOCK = threading.Lock()
_steady_holders = 0
_steady_added: list[str] = []


@contextlib.contextmanager
def steady_environment() -> Iterator[None]:
    """:data:`TOGGLED_ENV` set, where unset, while a run's threads (device threads, device-loader
    threads) run; removed again when the last holder leaves, last set first (each is then the array's
    last entry, and removing it moves no other). Nested and concurrent holders share one setting: the
    device-thread group holds it before its threads start, and each device function holds it too,
    which in an ``xmp.spawn`` process (whose device functions run in a pool thread) is the only holder.

    The threads of a process share one C environment, which libc's ``getenv`` reads without a lock.
    A ``setenv`` of a variable it lacks may move the array (``realloc``) and an ``unsetenv`` shifts
    it, under a reader in another thread; torch's and torch_xla's C++ read variables while they
    trace and run, and a reader of the freed array crashed the process in ``getenv``. With these set
    already, the upstream writes overwrite a value in place, which ``getenv`` survives.
    (accelerate's ``clear_environment``, which unsets and sets every variable, is the Trainer
    integration's to replace.)"""
    global _steady_holders
    with _STEADY_LOCK:
        if _steady_holders == 0:
            _steady_added[:] = [k for k in TOGGLED_ENV if k not in os.environ]
            for k in _steady_added:
                os.environ[k] = TOGGLED_ENV[k]
        _steady_holders += 1
    try:
        yield
    finally:
        with _STEADY_LOCK:
            _steady_holders -= 1
            if _steady_holders == 0:
                for k in reversed(_steady_added):
                    os.environ.pop(k, None)


def _thread_runner() -> Callable | None:
    """What ``xmp.spawn``'s CPU process runs, here: torch_xla 2.9's thread-per-device runner with the
    multi-process initializer, which also sets the replication devices (``xr.world_size()`` is 1
    without it; ``pjrt.spawn_threads`` skips it). None where a release lacks either, and then
    ``xmp.spawn`` starts its process."""
    try:
        from torch_xla._internal import pjrt
    except ImportError:
        return None
    run, init, wrap = (
        getattr(pjrt, n, None) for n in ("_run_thread_per_device", "initialize_multiprocess", "_SpawnFn")
    )
    if run is None or init is None or wrap is None:
        return None
    return lambda fn, args: run(local_rank=0, local_world_size=1, fn=wrap(fn, *args), initializer_fn=init)


def without_ordinal(fn: Callable[[], None], ordinal: int) -> None:
    fn()


def _call_with_ordinal(index: int, fn: Callable[[int], None]) -> None:
    import torch_xla.runtime as xr

    try:
        with steady_environment():
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
