"""``python xla_launch.py MODE``: ``shardcore.launch`` of XLA FSDP on the CPU devices, in this process.

MODE ``twice``: two launches, one after the other, each training the sharded Llama two steps;
prints where each device ran (process, ordinal) and its losses. MODE ``touched``: the XLA runtime
started before the launch, without the CPU recipe; prints the error the launch raised."""

import json
import os
import sys
import threading

import torch
import torch_xla
import torch_xla.runtime as xr

import shardcore
from shardcore_conformance.models import loss_fn, make_batches

from xla_common import sharded_llama

RAN = []
_LOCK = threading.Lock()


def job(launch: int) -> None:
    model, backend = sharded_llama("fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in make_batches("llama", 2, 8, 0):
        loss = loss_fn("llama", model, backend.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        backend.step_end()
        losses.append(float(loss))
    with _LOCK:
        RAN.append({"launch": launch, "pid": os.getpid(), "ordinal": xr.global_ordinal(), "losses": losses})


if __name__ == "__main__":
    if sys.argv[1] == "touched":
        torch_xla.device()  # the runtime starts here, with the asynchronous CPU client
        try:
            shardcore.launch(job, {"xla": True}, args=(0,))
            error = None
        except shardcore.ShardcoreError as e:
            error = {"type": type(e).__name__, "message": str(e)}
        print(json.dumps({"error": error, "ran": RAN}))
    else:
        for launch in range(2):
            shardcore.launch(job, {"xla": True}, args=(launch,))
        print(json.dumps({"pid": os.getpid(), "ran": RAN}))
