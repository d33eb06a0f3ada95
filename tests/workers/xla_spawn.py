"""``python xla_spawn.py``: xmp.spawn straight away (no shardcore launcher) and shard a model under
XLA FSDP; device 0 prints ``{"error": ...}``, the error shard() raised (the test runs this without
the CPU recipe's environment)."""

import json

import torch_xla.distributed.xla_multiprocessing as xmp

import shardcore

from xla_common import sharded_llama


def shard_and_report(index: int) -> None:
    try:
        sharded_llama("fsdp")
        error = None
    except shardcore.ShardcoreError as e:
        error = {"type": type(e).__name__, "message": str(e)}
    if index == 0:
        print(json.dumps({"error": error}), flush=True)


if __name__ == "__main__":
    xmp.spawn(shard_and_report)
