"""What the checkpoint workers (``ckpt_*.py``, run by torchrun) share. Every rank runs the scenario;
rank 0 writes what the test checks into the directory it is given (per-rank checks go to
``DIR/<name>.rank<r>.json``). The model is the conformance suite's tiny Llama with tied embeddings,
trained with AdamW on the conformance batches, so every run sees the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import shardcore
from shardcore_conformance.models import loss_fn, make_batches, tiny_llama_config

STEPS = 6
BATCH = 8
LR = 1e-2


def build(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True, **overrides))


def sharded(seed: int = 0, config: dict | None = None, **overrides):
    model = shardcore.shard(build(seed, **overrides), config or {})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, opt


def backend(model):
    return shardcore.handle(model).backend


def train(model, opt, first: int, last: int, case_model: str = "llama") -> list[float]:
    """Steps ``first``..``last - 1`` of the fixed schedule (the batches of the conformance model
    ``case_model``); the global mean loss of each."""
    rt = backend(model)
    losses = []
    for batch in make_batches(case_model, STEPS, BATCH, 0)[first:last]:
        loss = loss_fn(case_model, model, rt.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(rt.all_reduce_sum(loss.detach()) / rt.world().size))
    return losses


def full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend(model).full_state_dict(model).items()}


def probe() -> torch.Tensor:
    return torch.arange(24).reshape(2, 12) % 97


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe()).logits.detach().cpu()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def expect_error(fn, *needles: str) -> str:
    try:
        fn()
    except shardcore.CheckpointError as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        if missing:
            raise AssertionError(f"error message lacks {missing}: {msg}") from e
        return msg
    raise AssertionError("no CheckpointError was raised")


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def max_diff_to(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest |difference| over ``ref``'s keys (tied names missing from ``ref`` are skipped)."""
    assert set(ref) <= set(state), sorted(set(ref) - set(state))
    return max(float((state[k].float() - ref[k].float()).abs().max()) for k in ref)


def write(d: Path, name: str, obj) -> None:
    if rank() == 0:
        torch.save(obj, d / name)


def write_rank(d: Path, name: str, obj) -> None:
    (d / f"{name}.rank{rank()}.json").write_text(json.dumps(obj))


def run(scenario, *args) -> None:
    """``scenario(*args)`` on this rank, deterministic on one thread; then every rank meets and ends
    its process group."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    scenario(*args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
