"""XLA FSDP on several CPU PJRT devices: the runtime settings it needs and the device-thread group.

On CPU, ``xmp.spawn`` / ``torch_xla.launch`` start one process whose devices are threads. torch_xla
2.9 builds its collectives without a channel id, so XLA:CPU keys each rendezvous by the id of the
compiled module: every device thread must run the *same* compiled module, and nothing of the recipe
below can be left out (each piece was removed in turn; the run then aborted at a rendezvous):

* each step's ``torch_xla.sync()`` is serialized across the device threads (barrier, lock, barrier):
  the first thread compiles, the others hit torch_xla's compile cache, whose key has no device;
* ``pin_layout_in_collective_ops=False``: a pinned all_gather is lowered as "pad by ordinal +
  all_reduce", so each thread would trace a different graph and compile its own module;
* ``PJRT_CPU_ASYNC_CLIENT=0``: the asynchronous CPU client (the default) chains launches, and two
  devices' collectives deadlock until XLA's fixed 10 s rendezvous abort;
* ``XLA_THREAD_POOL_SIZE >= devices``: each device's execution holds a torch_xla pool thread at the
  rendezvous; the default pool is the core count, so more devices than cores never all arrive;
* the cycle collector runs once, with every device thread stopped, right before the serialized
  syncs: ``torch_xla.sync()`` makes every *live* tensor of the device an output of the step's graph,
  and a lazy tensor held by cyclic garbage (autograd graphs, hook closures) is live until the
  collector happens to run. When it ran on one device's garbage and not yet on another's (any
  allocation may trigger it, on any thread), the two graphs differed by an output, the second
  device compiled a module of its own and the run aborted at a rendezvous, now and then (repro:
  ``tests/test_xla_runtime.py::test_cyclic_garbage_does_not_split_the_step_graph``). A full collection of a
  process that imported Transformers scans ~490k objects (~200 ms), so the first step end freezes
  what is alive then (``gc.freeze()``: the model, the optimizer, the imported modules; reference
  counting still frees them) and every later collection scans only what training created (~0.1 ms).

Devices must also trace the same graph. Besides the cycle collector, torch_xla's XLA FSDP made them
differ: it skips the pre-backward hook of an output whose ``id()`` it recorded for an earlier, dead
output, and device threads recycle addresses differently (fixed in unit_fix.py, fix 3).

torch_xla 2.9 counts CPU-fallback ops (an op it has no lowering for, ``.item()`` among them) in a
plain ``std::unordered_map`` (``torch_xla::_fallback_counters``) that ``xla_fallback`` searches and
inserts into without a lock. The first fallback of each op name inserts. Device threads reach their
first ``.item()`` together, when a loop reads its loss right after the step end, and one thread's
insert (a rehash) under another's lookup crashed the process with a segfault in
``_Hashtable<string, Counter*>::_M_find_before_node`` (seen in dmesg now and then, the device
process gone without a message). The group's creator inserts that counter first
(:func:`_insert_fallback_counters`), while the other threads wait for the group.

``torch_xla.utils.checkpoint.chkpt_status`` ("this thread is in a checkpointed backward", which tells
XLA FSDP to skip an all-gather) is one object for the process; device threads would read each
other's flag and recompute a unit with freed weights, so it is made thread-local
(:func:`thread_local_checkpoint_status`).

torch_xla's own ``xm.rendezvous`` syncs without that serialization and gathers with a pinned layout,
so barriers, broadcasts and gathers between device threads go through Python memory instead
(:class:`DeviceThreads`): the threads share one address space.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from typing import Any

import torch

from shardcore.errors import DistributedSetupError

ASYNC_CLIENT = "PJRT_CPU_ASYNC_CLIENT"
POOL_SIZE = "XLA_THREAD_POOL_SIZE"
_FALSE = ("0", "false", "False", "FALSE")
log = logging.getLogger(__name__)


def recipe_env(devices: int) -> dict[str, str]:
    """The environment XLA FSDP needs on ``devices`` CPU PJRT devices, to set before the runtime starts."""
    return {ASYNC_CLIENT: "0", POOL_SIZE: str(max(2 * devices, os.cpu_count() or 1))}


def runtime_initialized() -> bool:
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def prepare(devices: int) -> None:
    """Set :func:`recipe_env` where the variables are unset and the runtime has not started (a value
    the user exported is left alone, and checked by :func:`check`)."""
    if runtime_initialized():
        return
    for k, v in recipe_env(devices).items():
        os.environ.setdefault(k, v)


def problems(devices: int, env: dict[str, str] | None = None) -> list[str]:
    """What in ``env`` (default: this process's environment) breaks XLA FSDP on ``devices`` CPU
    devices: one sentence per variable, naming it, its value and the fix."""
    env = os.environ if env is None else env
    out = []
    value = env.get(ASYNC_CLIENT)
    if value not in _FALSE:
        out.append(
            f"{ASYNC_CLIENT} is {'unset' if value is None else repr(value)}: torch_xla's asynchronous CPU client chains "
            "the devices' launches, and their collectives deadlock until XLA aborts the process after 10 s. "
            f"Export {ASYNC_CLIENT}=0 before the XLA runtime starts."
        )
    pool = env.get(POOL_SIZE)
    size = (os.cpu_count() or 1) if pool is None else _int(pool)
    if size is None or size < devices:
        shown = f"unset (so the core count, {size})" if pool is None else repr(pool)
        out.append(
            f"{POOL_SIZE} is {shown}: each of the {devices} devices holds one torch_xla pool thread while it waits "
            f"for the others, so fewer threads than devices never all arrive. Export {POOL_SIZE}={2 * devices} "
            "(or more) before the XLA runtime starts."
        )
    return out


def _int(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def check(devices: int) -> None:
    """Raise :class:`DistributedSetupError` if the already started runtime lacks the recipe."""
    found = problems(devices)
    if found:
        raise DistributedSetupError(
            f"shardcore xla: XLA FSDP on {devices} CPU PJRT devices cannot run with this process's XLA runtime, "
            "which has already started, so these settings can no longer change: " + " ".join(found) + " "
            "shardcore sets them itself when it starts the devices (shardcore-conformance, the backend's "
            "run_on_devices) or when shard() runs before the runtime starts; with your own xmp.spawn or "
            "torch_xla.launch, export them in the shell or set os.environ before that call."
        )


def thread_local_checkpoint_status() -> None:
    """Make torch_xla's process-wide checkpoint flag per thread (idempotent). The flag is set and
    read within one backward, which autograd runs on one thread per device."""
    from torch_xla.utils import checkpoint

    status = checkpoint.chkpt_status
    if isinstance(status, _ThreadLocalStatus):
        return
    with _GROUPS_LOCK:
        if not isinstance(status, _ThreadLocalStatus):
            status.__class__ = _thread_local_status_class(type(status))


class _ThreadLocalStatus:
    pass


def _thread_local_status_class(base: type) -> type:
    local = threading.local()

    class ThreadLocalCheckpointStatus(base, _ThreadLocalStatus):
        @property
        def in_chkpt_bwd(self) -> bool:
            return getattr(local, "value", False)

        @in_chkpt_bwd.setter
        def in_chkpt_bwd(self, value: bool) -> None:
            local.value = value

    return ThreadLocalCheckpointStatus


class DeviceThreads:
    """The ``size`` device threads of one process, meeting in Python.

    ``timeout`` bounds every wait, so a thread that died makes the others fail instead of hang
    (:meth:`abort` makes them fail at once)."""

    def __init__(self, size: int, timeout: float):
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(size, timeout=timeout)
        # its action runs in one thread once all have arrived and before any leaves
        self._collecting = threading.Barrier(size, action=self._start_round, timeout=timeout)
        self._slots: list[Any] = [None] * size
        self._synced = 0  # syncs of this round so far: only the first may compile
        self._frozen = False

    def _start_round(self) -> None:
        gc.collect()
        if not self._frozen:
            gc.freeze()
            self._frozen = True
        self._synced = 0

    def wait(self, barrier: threading.Barrier | None = None) -> None:
        try:
            if _FAILED.is_set():
                raise threading.BrokenBarrierError
            (barrier or self._barrier).wait()
        except threading.BrokenBarrierError:
            raise DistributedSetupError(
                f"shardcore xla: a device thread did not arrive within {self.timeout:g} s, or failed (see its "
                "error above); the other devices stop here instead of waiting forever."
            ) from None

    def abort(self) -> None:
        self._barrier.abort()
        self._collecting.abort()

    def sync(self) -> None:
        """``torch_xla.sync()`` on every device thread, one after another, so that all of them run the
        module the first one compiled."""
        import torch_xla

        self.wait(self._collecting)  # every thread has traced this step; no cyclic garbage is left
        with self._lock:
            first = self._synced == 0
            self._synced += 1
            before = torch_xla._XLAC._xla_get_num_cached_compilation_graph()
            torch_xla.sync()
            compiled = torch_xla._XLAC._xla_get_num_cached_compilation_graph() > before
        if compiled and not first:
            # harmless for a graph without collectives (loading weights on device 0 only); with
            # collectives, XLA kills the process 10 s from now, before a raised error could be
            # printed, so this is logged, not raised
            log.warning(
                "shardcore xla: this device traced a different graph than the device that synced first and "
                "compiled a module of its own. If the step has collectives they cannot meet and XLA aborts the "
                "process after 10 s: the step's Python took a data-dependent branch on a lazy tensor (Python "
                "max(), min() or an if on a tensor, .item()), or the devices ran different code, or kept "
                "different tensors alive. Keep the step the same on every device; compute on tensors instead."
            )
        self.wait()  # every thread has queued this step before any traces the next

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        """Every thread's ``obj``, by rank. Collective."""
        self._slots[rank] = obj
        self.wait()
        out = list(self._slots)
        self.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def gather_cpu(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every thread's ``tensor`` on CPU, by rank (a device-side tensor is materialized first,
        through :meth:`sync`). Collective."""
        self.sync()
        return self.exchange(rank, tensor.detach().cpu())


_GROUPS: dict[int, DeviceThreads] = {}
_GROUPS_LOCK = threading.Lock()
# set once a device thread of this process has failed: the others must not wait for it, even in a
# group created after the failure
_FAILED = threading.Event()


def device_threads(size: int, timeout: float) -> DeviceThreads:
    """The process's group of ``size`` device threads (created by the first thread that asks)."""
    with _GROUPS_LOCK:
        group = _GROUPS.get(size)
        if group is None:
            _insert_fallback_counters()
            group = _GROUPS[size] = DeviceThreads(size, timeout)
        return group


def _insert_fallback_counters() -> None:
    """Make torch_xla insert its counter of ``.item()`` (``aten::_local_scalar_dense``, the CPU
    fallback every training loop that reads a value hits) while no other device thread runs XLA ops;
    afterwards the threads only look it up, which is safe concurrently. Other fallback ops that
    several device threads reach for the first time at once still race inside torch_xla."""
    import torch_xla
    import torch_xla.debug.metrics as met

    if "aten::_local_scalar_dense" not in met.executed_fallback_ops():
        torch.zeros((), device=torch_xla.device()).item()


def aborted() -> bool:
    """Whether a device thread of this process has failed."""
    return _FAILED.is_set()


def abort_all() -> None:
    """Wake every device thread of this process waiting in a group, and make every later wait fail
    (one of them failed)."""
    _FAILED.set()
    with _GROUPS_LOCK:
        for group in _GROUPS.values():
            group.abort()
