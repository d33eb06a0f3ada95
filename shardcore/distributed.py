"""Process-group set-up shared by backends that use ``torch.distributed``.

Reads what ``torchrun`` and ``accelerate launch`` export (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). Without them the process is a world of one. Every wait is bounded by
the config's ``timeout`` so that a peer that never comes fails the run instead of hanging it.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .errors import BatchError, DistributedSetupError

log = logging.getLogger(__name__)

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment; (0, 1, 0) without one."""
    env = os.environ
    present = [v for v in _LAUNCH_VARS if v in env]
    if not present:
        return 0, 1, 0
    missing = [v for v in _LAUNCH_VARS if v not in env]
    if missing:
        raise DistributedSetupError(
            f"shardcore: launcher environment is incomplete: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Launch with torchrun or accelerate launch, or set all of "
            f"{', '.join(_LAUNCH_VARS)}."
        )
    try:
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError as e:
        raise DistributedSetupError(f"shardcore: RANK/WORLD_SIZE/LOCAL_RANK must be integers ({e}).") from None
    if not 0 <= rank < size:
        raise DistributedSetupError(f"shardcore: RANK={rank} is outside WORLD_SIZE={size}.")
    return rank, size, local


def ensure_process_group(timeout_s: float, device_type: str, timeout_set: bool = False) -> None:
    """Initialise the default process group if the training script has not done so, for ranks on
    ``device_type`` (:func:`shardcore.devices.requested`): this rank's device is made current
    (``LOCAL_RANK``) and the group gets that device's backend with gloo beside it for CPU tensors
    (:func:`shardcore.devices.process_group_backend`).

    An existing group must agree with the launcher's RANK / WORLD_SIZE. Once the group has more than
    one rank, each rank records its host and pid, so that a failed collective later says which rank
    was lost (see :func:`describe_peers`). ``timeout_set``: the config sets ``timeout``, which then
    also applies to a group that already exists (one the script, or an earlier ``shard``, made)."""
    from . import devices

    if dist.is_initialized():
        _check_existing_group()
        _check_gloo_threads(dist.group.WORLD)
        if timeout_set:
            # private, but the one way torch offers to change an existing group's timeout (gloo and NCCL)
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), dist.group.WORLD)
        devices.choose(device_type)
        _watch_peers()
        return
    rank, size, local = env_world()
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = devices.process_group_backend(device_type)
    devices.set_device(device_type, local)
    devices.choose(device_type)
    try:
        if size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - torch raises several types (DistStoreError, RuntimeError)
        raise DistributedSetupError(
            f"shardcore: could not join the process group as rank {rank} of {size} at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within {timeout_s:g}s "
            f"({type(e).__name__}: {e}). Check that all {size} ranks were started, or raise the "
            "config key 'timeout'."
        ) from e
    log.info("shardcore: joined process group %s as rank %d of %d", backend, rank, size)
    _destroy_at_exit(dist.group.WORLD)
    _watch_peers()


def _destroy_at_exit(group: Any) -> None:
    """Tear down, at interpreter exit, the process group shardcore created (a script's own group is
    the script's to destroy). Left to static destruction, gloo's worker threads still hold work
    whose tensors reference Python objects; freeing them needs the GIL of an interpreter that is
    gone, and the rank dies with SIGABRT ("terminate called without an active exception") after
    finishing its work (pytorch/pytorch PR 179291 describes the same crash)."""

    def destroy() -> None:
        if dist.is_initialized() and dist.group.WORLD is group:
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - at exit: report, never mask the exit status
                log.warning("shardcore: destroying the process group at exit failed: %s", e)

    atexit.register(destroy)


def _check_existing_group() -> None:
    """A process group made by the script must be the world the launcher says it is."""
    size, rank = dist.get_world_size(), dist.get_rank()
    for var, have in (("WORLD_SIZE", size), ("RANK", rank)):
        want = os.environ.get(var)
        if want is not None and want.strip() != str(have):
            raise DistributedSetupError(
                f"shardcore: the initialized process group has {var.lower().replace('_', ' ')} {have} but the "
                f"launcher's {var}={want}. The mesh is built from the process group, so they must agree: "
                f"pass world_size=int(os.environ['WORLD_SIZE']) and rank=int(os.environ['RANK']) to "
                "init_process_group, or let shardcore.shard() create the group."
            )


# ---------------------------------------------------------------- gloo's worker threads

#: torch's own ProcessGroupGloo.__init__, for the tests and the by-hand repro (workers/gloo_race.py)
_GLOO_INIT: Any = None


def one_worker_gloo() -> None:
    """Give every gloo process group made from now on one worker thread instead of torch's two.

    Why: torch runs each gloo group's collectives on two threads. After each collective a thread
    stores the op's name in the group's status (``pgStatus_->lastCompletedWorkName``) before it
    takes the group's lock back. When both threads finish at once, both replace that string. A name
    longer than 15 characters lives on the heap: ``ALLGATHER_COALESCED`` is one, and every
    functional all-gather runs it (DTensor, tensor parallelism). Both threads then free the same
    buffer. The rank dies later with SIGABRT
    (``malloc(): unaligned tcache chunk detected``, ``free(): invalid pointer``) or SIGSEGV, or a
    collective hangs. torch 2.9 and 2.13 both do it. With one thread nothing runs beside it.

    torch has no setting for it: ``new_group`` ignores gloo options, and DeviceMesh makes its groups
    with ``new_group``. So the constructor that takes a timeout asks for one thread. The devices
    are what torch would pick (``GLOO_SOCKET_IFNAME``, else the host's address). A group built
    from explicit ``ProcessGroupGloo._Options`` keeps what they say. Collectives of one group then
    run in the order they were issued, as NCCL runs them on one stream."""
    global _GLOO_INIT
    if _GLOO_INIT is not None or not dist.is_available() or not dist.is_gloo_available():
        return
    from torch.distributed import ProcessGroupGloo

    torch_init = ProcessGroupGloo.__init__
    default_timeout = datetime.timedelta(minutes=30)

    def __init__(self, store, rank, size, timeout=default_timeout, options=None):  # noqa: ANN001
        if options is None and isinstance(timeout, ProcessGroupGloo._Options):
            options = timeout
        if options is None:
            options = ProcessGroupGloo._Options()
            names = os.environ.get("GLOO_SOCKET_IFNAME", "")
            if len(names) > 1:  # torch's own test: one character is no interface name
                options._devices = [ProcessGroupGloo.create_device(interface=n) for n in names.split(",")]
            else:
                options._devices = [ProcessGroupGloo.create_default_device()]
            options._timeout = timeout
            options._threads = 1
        torch_init(self, store, rank, size, options)

    __init__.__doc__ = torch_init.__doc__
    ProcessGroupGloo.__init__ = __init__
    _GLOO_INIT = torch_init


def gloo_threads(group: Any) -> int | None:
    """How many worker threads ``group``'s gloo backend runs; None without one."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no backend for CPU tensors
        return None
    options = getattr(backend, "options", None)
    return getattr(options, "_threads", None)


def _check_gloo_threads(group: Any) -> None:
    threads = gloo_threads(group)
    if threads is not None and threads > 1:
        log.warning(
            "shardcore: the default process group's gloo backend runs %d worker threads: it was made "
            "before shardcore was imported, or from explicit options. torch's gloo workers race when "
            "two collectives finish together, and corrupt the heap now and then (a rank dies later "
            "by SIGABRT or SIGSEGV; docs/training.md, 'Gloo's worker threads'). Import shardcore "
            "before init_process_group to get one thread per group.",
            threads,
        )


# ---------------------------------------------------------------- lost peers

#: ``SHARDCORE_EXCEPTHOOK=0`` keeps sys.excepthook as the script set it (a script or framework with
#: its own hook, e.g. for crash reporting); a lost rank then surfaces as torch's own error
EXCEPTHOOK_VAR = "SHARDCORE_EXCEPTHOOK"

_peers: dict[int, tuple[str, int]] = {}  # rank -> (hostname, pid), filled once the group is up
_hook_installed = False


def _watch_peers() -> None:
    """Record every rank's (host, pid) in the group's store and install an excepthook that, when a
    collective fails uncaught (gloo: 'Connection reset by peer' once a peer died, or a timeout once
    it stopped answering), ends the process with a DistributedSetupError naming the lost rank
    (unless ``SHARDCORE_EXCEPTHOOK=0``)."""
    global _hook_installed
    size = dist.get_world_size()
    # "fake": the one-process group that shardcore plan shards under (no peers to lose)
    if size == 1 or _peers or dist.get_backend() == "fake":
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        store.set(f"shardcore/peer/{me}", json.dumps([socket.gethostname(), os.getpid()]))
        for r in range(size):  # every rank calls shard(); bounded by the store's timeout
            host, pid = json.loads(store.get(f"shardcore/peer/{r}"))
            _peers[r] = (host, int(pid))
    except Exception as e:  # noqa: BLE001 - diagnostics only; never fail sharding for them
        log.warning("shardcore: could not record peer processes (%s); lost ranks will not be named", e)
        _peers.clear()
        return
    if not _hook_installed and os.environ.get(EXCEPTHOOK_VAR, "1") != "0":
        previous = sys.excepthook

        def hook(exc_type, exc, tb):  # noqa: ANN001
            if isinstance(exc, RuntimeError) and not isinstance(exc, DistributedSetupError) and _is_comm_failure(exc):
                err = DistributedSetupError(describe_peers(str(exc)))
                err.__cause__ = exc
                return previous(DistributedSetupError, err, tb)
            return previous(exc_type, exc, tb)

        sys.excepthook = hook
        _hook_installed = True


def _is_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(m in text for m in ("gloo", "Connection reset", "Connection closed", "Timed out", "NCCL"))


def _process_state(pid: int) -> str:
    """'gone', 'stopped', 'alive' (a local pid), from /proc where there is one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "alive")
    except FileNotFoundError:
        return "gone"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass
    return "alive"


def describe_peers(cause: str = "") -> str:
    """Which ranks this one lost: each peer on this host is checked by pid; peers elsewhere are
    listed as unchecked. Used to explain a failed collective."""
    me = dist.get_rank() if dist.is_initialized() else None
    size = len(_peers)
    host = socket.gethostname()
    # a killed peer's sockets close before the kernel marks it exited: give it a moment
    deadline = time.monotonic() + 3.0
    while True:
        gone, stopped, unchecked = [], [], []
        for r, (h, pid) in sorted(_peers.items()):
            if r == me:
                continue
            if h != host:
                unchecked.append(f"rank {r} (pid {pid} on {h})")
                continue
            state = _process_state(pid)
            if state == "gone":
                gone.append(f"rank {r} (pid {pid})")
            elif state == "stopped":
                stopped.append(f"rank {r} (pid {pid})")
        if gone or stopped or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    parts = []
    if gone:
        parts.append(f"lost {', '.join(gone)}: the process has exited or was killed")
    if stopped:
        parts.append(f"{', '.join(stopped)} is stopped (SIGSTOP?) and did not answer within the config's 'timeout'")
    if not parts:
        parts.append(
            "no peer on this host has exited" + (f"; not checked: {', '.join(unchecked)}" if unchecked else "")
        )
    first = cause.strip().splitlines()[0][:300] if cause.strip() else ""
    return (
        f"shardcore: a collective failed on rank {me} of {size}: {'; '.join(parts)}. "
        + (f"({first}) " if first else "")
        + "The other ranks cannot go on without it; restart every rank (from the last checkpoint)."
    )


class TorchDistributedRuntime:
    """The rank-level half of a backend built on ``torch.distributed`` (one process per rank):
    world, barrier, reductions and per-rank batches. The FSDP2 backend and the out-of-tree example
    in ``examples/vendor_backend`` both inherit it; a vendor backend over torch.distributed can too."""

    def is_available(self) -> tuple[bool, str]:
        from . import devices

        if not dist.is_available():
            return False, "this torch build has no torch.distributed"
        try:
            t = devices.requested()
            return True, f"{t} + {devices.process_group_backend(t)}"
        except DistributedSetupError as e:  # shard() raises it where the group is made
            return True, f"torch.distributed present, but shard() will refuse: {e}"

    def world(self):
        from .backend import World

        if not dist.is_initialized():
            return World(0, 1, self._device())
        return World(dist.get_rank(), dist.get_world_size(), self._device())

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size() > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), by rank. Collective."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's contiguous slice (along dim 0) of a global batch, on this rank's device."""
        w = self.world()
        return slice_rows(batch, w.rank, w.size, w.device, "ranks")

    def _device(self) -> torch.device:
        from . import devices

        return devices.current_device()


def slice_rows(
    batch: dict[str, torch.Tensor], index: int, parts: int, device: Any, what: str
) -> dict[str, torch.Tensor]:
    """Part ``index`` of ``parts`` contiguous slices of every field along dim 0, on ``device``."""
    check_batch_divides(batch, parts, what)
    out = {}
    for k, v in batch.items():
        n = v.shape[0] // parts
        out[k] = v[index * n : (index + 1) * n].to(device)
    return out


def check_batch_divides(batch: dict[str, Any], parts: int, what: str) -> None:
    """Every backend's ``local_batch`` refuses a global batch it cannot split evenly over ``parts``
    ranks or devices (``what``) with this one error, before slicing anything."""
    for k, v in batch.items():
        if v.shape[0] % parts:
            raise BatchError(
                f"shardcore: batch field {k!r} has {v.shape[0]} rows, not divisible by the {parts} {what}. "
                f"Use a global batch size that is a multiple of {parts}."
            )
