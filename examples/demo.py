"""Demo: a tiny Llama trained with ``shardcore.shard`` on the ranks torchrun started, side by side
with the same model trained on one device.

    torchrun --standalone --nproc_per_node 2 examples/demo.py      (what `make demo` runs)
    accelerate launch --config_file fsdp.yaml examples/demo.py --config fsdp.yaml

Every rank builds the model from one seed, shards it (FSDP2: gloo on CPU, NCCL on CUDA) and trains on
its slice of each global batch. Rank 0 then trains an unsharded copy on the whole batches and prints
both losses per step.
"""
from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardcore

CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # units: the model's _no_split_modules (LlamaDecoderLayer)
    "reshard_after_forward": True,
    "state_dict_type": "FULL_STATE_DICT",
}


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def batches(steps: int, global_batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # a learnable pattern (shifted ranges) so the loss visibly falls within a few steps
    starts = torch.randint(0, 200, (steps, global_batch, 1), generator=g)
    return [(s + torch.arange(32)) % 256 for s in starts]


def train(model, data, step_fn) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in data:
        loss = step_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--config", help="JSON FSDP config or accelerate YAML (default: the CONFIG dict above)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    data = batches(args.steps, args.global_batch)

    model = shardcore.shard(build(), args.config or CONFIG)
    backend = shardcore.handle(model).backend
    world = backend.world()

    def sharded_step(m, ids):
        local = backend.local_batch({"input_ids": ids, "labels": ids})
        return m(**local).loss

    sharded = [float(backend.all_reduce_sum(l.detach()) / world.size) for l in train(model, data, sharded_step)]

    if world.rank == 0:
        reference = [float(l) for l in train(build(), data, lambda m, ids: m(input_ids=ids, labels=ids).loss)]
        print(f"shardcore demo: tiny Llama, {world.size} ranks ({backend.name}, {world.device.type}) vs one device")
        print(f"{'step':>4}  {'sharded loss':>14}  {'single-device':>14}  {'|diff|':>10}")
        for i, (a, b) in enumerate(zip(sharded, reference)):
            print(f"{i:>4}  {a:>14.8f}  {b:>14.8f}  {abs(a - b):>10.2e}")
        print(f"max |diff| over {len(sharded)} steps: {max(abs(a - b) for a, b in zip(sharded, reference)):.2e}")
    backend.barrier()


if __name__ == "__main__":
    main()
