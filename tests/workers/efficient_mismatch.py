"""``efficient_mismatch.py differ|meta OUT_DIR``: ``cpu_ram_efficient_loading`` with a model rank 0 cannot
fill: rank 1's model has another shape (``differ``), or rank 0's is on the meta device (``meta``).
Every rank writes OUT_DIR/rank<r>.json: the error it got and whether the backend's ``apply`` ran: the check must end
every rank with the same error before anything is sharded, and no rank may hang."""

import json
import os
import sys
from pathlib import Path

import torch

import shardcore
from shardcore_conformance.models import MLP
from shardcore_fsdp2 import FSDP2Backend


class Recording(FSDP2Backend):
    applied = False

    def apply(self, model, plan, config):
        Recording.applied = True
        return super().apply(model, plan, config)


rank = int(os.environ["RANK"])
if sys.argv[1] == "differ":
    model = MLP(hidden=33 if rank == 0 else 34)
else:
    with torch.device("meta" if rank == 0 else "cpu"):
        model = MLP()
try:
    shardcore.shard(model, {"cpu_ram_efficient_loading": True, "timeout": 60}, backend=Recording())
    error = None
except shardcore.ShardcoreError as e:
    error = {"type": type(e).__name__, "key": getattr(e, "key", None), "message": str(e)}
# a file per rank: torchrun interleaves the ranks' stdout
Path(sys.argv[2], f"rank{rank}.json").write_text(
    json.dumps({"rank": rank, "error": error, "applied": Recording.applied})
)
