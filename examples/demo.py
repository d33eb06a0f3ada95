"""Demo: a tiny Llama trained with ``shardcore.shard``, side by side with the same model trained on
one device. One training loop, with gradient accumulation and clipping, for every backend: only the
config changes.

    torchrun --standalone --nproc_per_node 2 examples/demo.py                    (FSDP2; `make demo`)
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/demo.py --config examples/configs/xla_fsdp.json
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/demo.py --config examples/configs/xla_spmd.json
    accelerate launch --config_file fsdp.yaml examples/demo.py --config fsdp.yaml

Every rank shards the same model and trains on its part of each global batch. The main process
also trains an unsharded copy on the whole batches, prints both losses per step, and exits 1 if they
differ by more than --tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import threading

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardcore

CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # units: the model's _no_split_modules (LlamaDecoderLayer)
    "reshard_after_forward": True,
    "state_dict_type": "FULL_STATE_DICT",
}


# XLA FSDP on CPU runs main() once per device, as threads of one process, and the threads share torch's
# global generator: seeded and built at once, their draws interleave and the weights differ from run
# to run. shardcore gives every device device 0's weights, so the run is right, but not repeatable.
_BUILD = threading.Lock()


def build() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    with _BUILD:
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)


def batches(steps: int, global_batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # a learnable pattern (shifted ranges) so the loss visibly falls within a few steps
    starts = torch.randint(0, 200, (steps, global_batch, 1), generator=g)
    return [(s + torch.arange(32)) % 256 for s in starts]


def train(model, data, args, sc=None) -> tuple[list[float], list[float]]:
    """The training loop. ``sc`` is the sharded model's handle; None trains ``model`` as it is."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, norms = [], []
    for ids in data:
        micro = ids.chunk(args.grad_accum)
        step_loss = 0.0
        for i, m in enumerate(micro):
            batch = {"input_ids": m, "labels": m}
            # no gradient reduction until the last micro-batch of the step
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last or sc is None else shardcore.no_sync(model):
                loss = model(**(sc.local_batch(batch) if sc else batch)).loss / len(micro)
                loss.backward()
            step_loss = step_loss + loss.detach()
        norm = shardcore.clip_grad_norm_(model, args.max_grad_norm)
        opt.step()
        opt.zero_grad()
        if sc:
            sc.step_end()
            step_loss = sc.reduce(step_loss)  # mean over ranks, for logging
        losses.append(float(step_loss))
        norms.append(float(norm))
    return losses, norms


def main(args: argparse.Namespace) -> None:
    torch.use_deterministic_algorithms(True)
    data = batches(args.steps, args.global_batch)
    model = build()
    reference = copy.deepcopy(model)  # the unsharded copy starts from the very same weights
    model = shardcore.shard(model, args.config or CONFIG)
    sc = shardcore.handle(model)
    sharded, sharded_norms = train(model, data, args, sc)

    failed = False
    if sc.is_main_process:
        single, single_norms = train(reference, data, args)
        print(
            f"shardcore demo: tiny Llama, {sc.backend.name} on {sc.world_size} rank(s) ({sc.device}) vs one device; "
            f"grad_accum {args.grad_accum}, max_grad_norm {args.max_grad_norm}"
        )
        print(
            f"{'step':>4}  {'sharded loss':>14}  {'single-device':>14}  {'|diff|':>10}  {'grad norm':>10}  {'single':>10}"
        )
        for i, (a, b, na, nb) in enumerate(zip(sharded, single, sharded_norms, single_norms)):
            print(f"{i:>4}  {a:>14.8f}  {b:>14.8f}  {abs(a - b):>10.2e}  {na:>10.6f}  {nb:>10.6f}")
        worst = max(abs(a - b) for a, b in zip(sharded, single))
        print(f"max |diff| over {len(sharded)} steps: {worst:.2e}")
        failed = not worst <= args.tolerance
        if failed:
            print(f"FAIL: the sharded run differs from the single-device run by more than {args.tolerance:g}")
    sc.barrier()
    if failed:
        sys.exit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest loss difference that passes")
    ap.add_argument("--config", help="JSON FSDP config or accelerate YAML (default: the CONFIG dict above)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    # torchrun/accelerate started one process per rank: main runs here. XLA FSDP starts a rank per
    # device from this one process.
    shardcore.launch(main, args.config or CONFIG, args=(args,))
