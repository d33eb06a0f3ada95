"""``shard_mlp.py [TIMEOUT_S]``: shard an MLP in whatever launcher environment the test gives. With a
timeout, a DistributedSetupError is caught and printed as ``CLEAR ERROR: ...``; without, it ends the
process like any uncaught error."""

import sys

import shardcore
from shardcore_conformance.models import MLP

if len(sys.argv) > 1:
    try:
        shardcore.shard(MLP(), {"timeout": float(sys.argv[1])})
    except shardcore.DistributedSetupError as e:
        print("CLEAR ERROR:", e)
else:
    shardcore.shard(MLP(), {})
