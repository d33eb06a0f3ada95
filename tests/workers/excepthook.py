"""Shards an MLP on the ranks torchrun started and prints whether shardcore wrapped sys.excepthook."""

import sys

import shardcore
from shardcore_conformance.models import MLP

shardcore.shard(MLP(), {})
# init_process_group installs torch's own hook; shardcore's, when installed, wraps whatever was there
print(f"excepthook wrapped: {getattr(sys.excepthook, '__module__', None) == 'shardcore.distributed'}", flush=True)
