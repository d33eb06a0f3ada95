"""shardcore: shard a PyTorch model with one call and one config, on FSDP2 or XLA FSDP.

>>> model = shardcore.shard(model, {"reshard_after_forward": True})   # doctest: +SKIP
"""

from . import distributed
from .api import ShardedModel, handle, shard
from .backend import Backend, BackendInfo, World, available_backends, get_backend
from .checkpoint import CheckpointManager, from_pretrained, load, save
from .config import MixedPrecision, ShardConfig, parse_config
from .empty import init_empty_weights
from .errors import (
    AlreadyShardedError,
    BackendNotFoundError,
    BackendUnavailableError,
    BatchError,
    CheckpointError,
    DistributedSetupError,
    ShardConfigError,
    ShardcoreError,
    UnknownKeyError,
    UnsupportedKeyError,
    WrapPlanError,
)
from .loop import clip_grad_norm_, launch, no_sync
from .plan import MemoryEstimate, Unit, WrapPlan, build_plan, estimate_memory

# before any script or launcher makes a group: torch's two gloo workers race (distributed.py)
distributed.one_worker_gloo()

__version__ = "0.1.0"

__all__ = [
    "AlreadyShardedError",
    "Backend",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "BatchError",
    "CheckpointError",
    "CheckpointManager",
    "DistributedSetupError",
    "MemoryEstimate",
    "MixedPrecision",
    "ShardConfig",
    "ShardConfigError",
    "ShardedModel",
    "ShardcoreError",
    "Unit",
    "UnknownKeyError",
    "UnsupportedKeyError",
    "World",
    "WrapPlan",
    "WrapPlanError",
    "available_backends",
    "build_plan",
    "clip_grad_norm_",
    "estimate_memory",
    "from_pretrained",
    "get_backend",
    "handle",
    "init_empty_weights",
    "launch",
    "load",
    "no_sync",
    "parse_config",
    "save",
    "shard",
]
