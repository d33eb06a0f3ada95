"""Trains a sharded MLP forever, printing each step, until a test kills or stops a rank:
``rank_failure.py TIMEOUT_S`` on ranks started by ``harness.start_ranks``."""

import sys
import time

import torch

import shardcore
from shardcore_conformance.models import MLP

torch.manual_seed(0)
torch.set_num_threads(1)
model = shardcore.shard(MLP(), {"timeout": float(sys.argv[1])})
opt = torch.optim.AdamW(model.parameters())
for step in range(100000):
    model(torch.randn(4, 13)).sum().backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step}", flush=True)
    time.sleep(0.02)
