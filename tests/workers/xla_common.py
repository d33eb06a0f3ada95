"""What the XLA workers share: the sharded tiny Llama, a training loop, dumping the full state,
and running a scenario once per device thread (XLA FSDP on several devices) or once (SPMD, or one
device) with rank 0 printing the JSON the test reads.

MODE, the first argument of every XLA worker, is "spmd" (xla_fsdp_v2) or "fsdp"
(XlaFullyShardedDataParallel); "spmd-tp" is SPMD with ``tp_size`` 2 on the Llama of the suite's
``tp`` cases where there are 2 devices or more. PJRT settings are per process, so each worker is one process.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import torch_xla  # noqa: F401  (initialise XLA before any CPU backward: see shared/xla-notes.md)
from safetensors.torch import save_file

# here, not in the device threads: Transformers' lazy module loading is not thread-safe
from transformers import LlamaForCausalLM  # noqa: F401

import shardcore
from shardcore_conformance.models import build_model, loss_fn, make_batches


def llama(mode: str) -> str:
    """The conformance model MODE trains."""
    return "llama_tp" if mode == "spmd-tp" else "llama"


def sharded_llama(mode: str, grad_ckpt: bool = False, hook=None, **extra):
    cfg = {"xla": True, "xla_fsdp_v2": mode.startswith("spmd"), "xla_fsdp_grad_ckpt": grad_ckpt, **extra}
    if mode == "spmd-tp" and int(os.environ.get("CPU_NUM_DEVICES", "1")) > 1:
        cfg["tp_size"] = 2
    model = build_model(llama(mode), 0)
    if hook is not None:
        model.model.layers[0].mlp.register_forward_hook(hook)
    model = shardcore.shard(model, cfg)
    return model, shardcore.handle(model).backend


def train(model, backend, steps: int, after_step=None, opt=None, name: str = "llama"):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, batch in enumerate(make_batches(name, steps, 8, 0)):
        loss = loss_fn(name, model, backend.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        backend.step_end()
        float(loss)  # read the loss every step, as a training loop that logs it does
        if after_step:
            after_step(i)
    return opt


def dump(backend, model, opt, path: str, rank: int) -> None:
    """The full model and optimizer state, as one safetensors file (rank 0 writes it)."""
    tensors = {f"model.{k}": v for k, v in backend.full_state_dict(model).items()}
    osd = backend.full_optimizer_state_dict(model, opt)
    for name, st in osd["state"].items():
        tensors.update({f"optimizer.{name}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path)


def save_full(backend, model, path: str, rank: int) -> None:
    """The full model state (no optimizer), as one safetensors file (rank 0 writes it)."""
    full = backend.full_state_dict(model)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, path)


def emitter(rank: int):
    """``emit(obj)``: rank 0 prints ``obj`` as the JSON line the test reads; the others stay quiet."""

    def emit(obj) -> None:
        if rank == 0:
            print(json.dumps(obj), flush=True)

    return emit


def on_devices(mode: str, scenario, *args) -> None:
    """``scenario(*args, rank)`` once per device under XLA FSDP on several devices (the backend's
    run_on_devices, i.e. xmp.spawn, which pickles it: a module-level function, not a lambda), else
    once as rank 0."""
    devices = int(os.environ.get("CPU_NUM_DEVICES", "1"))
    if mode == "fsdp" and devices > 1:
        shardcore.get_backend("xla").run_on_devices(functools.partial(scenario, *args))
    else:
        scenario(*args, 0)
