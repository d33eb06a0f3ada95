"""Process-group set-up shared by backends that use ``torch.distributed``.

Reads what ``torchrun`` and ``accelerate launch`` export (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). Without them the process is a world of one. Every wait is bounded by
the config's ``timeout`` so that a peer that never comes fails the run instead of hanging it.
"""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from .errors import DistributedSetupError

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


def ensure_process_group(timeout_s: float, use_cuda: bool) -> None:
    """Initialise the default process group if the training script has not done so."""
    if dist.is_initialized():
        return
    rank, size, local = env_world()
    timeout = datetime.timedelta(seconds=timeout_s)
    if use_cuda:
        torch.cuda.set_device(local)
        # gloo beside NCCL so that CPU tensors (offloaded state, metadata) can be reduced too
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
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
