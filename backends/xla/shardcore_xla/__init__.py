"""shardcore backend for torch_xla: XLA FSDP (``XlaFullyShardedDataParallel``) and SPMD FSDPv2.

Importing this package does not import torch_xla; that happens when the backend is used.
"""

from .backend import XLABackend

__all__ = ["XLABackend"]
