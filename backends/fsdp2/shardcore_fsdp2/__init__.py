"""shardcore backend for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from .backend import FSDP2Backend

__all__ = ["FSDP2Backend"]
