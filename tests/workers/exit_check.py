"""``exit_check.py shardcore|script``: who owns the process group (shard() creates it, or the script
does first), and whether it is still alive when the script's last exit handler runs."""

import atexit
import os
import sys

import torch
import torch.distributed as dist

import shardcore

# registered before shard(): runs after shardcore's own exit handler (atexit is last in, first out)
atexit.register(lambda: print(f"rank {os.environ['RANK']} group alive at exit: {dist.is_initialized()}", flush=True))
if sys.argv[1] == "script":
    dist.init_process_group("gloo")
model = shardcore.shard(
    torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), {"auto_wrap_policy": "NO_WRAP"}
)
model(torch.ones(2, 4)).sum().backward()
shardcore.handle(model).barrier()
