"""shardcore backend for torch_xla: XLA FSDP (``XlaFullyShardedDataParallel``) and SPMD FSDPv2, two
implementations behind the one registered name ``xla`` (:class:`XLABackend` picks one by ``xla_fsdp_v2``).

Importing this package does not import torch_xla; that happens when the backend is used.
"""

from .backend import XLABackend
from .fsdp_backend import XlaFsdpBackend
from .spmd_backend import SpmdBackend

__all__ = ["SpmdBackend", "XLABackend", "XlaFsdpBackend"]
