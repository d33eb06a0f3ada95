"""One tiny Llama run with gradient clipping and accumulation, through the Transformers ``Trainer``
(``trainer OUT``) or through shardcore's loop surface on the ranks torchrun started
(``shardcore OUT``), so tests/test_loop.py can compare the two step by step.

Both sides see the same initial weights (one seed, built on CPU), the same batches in the same
order (the Trainer's sequential sampler) and the same AdamW; each writes its per-step loss and
gradient norm (before clipping) as JSON.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

ROWS, SEQ, STEPS = 32, 32, 4
PER_DEVICE, ACCUM, LR, MAX_NORM = 4, 2, 1e-2, 1.0


def build():
    """The demo's tiny Llama (examples/demo.py), so this parity check covers the model users run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from demo import build as demo_build

    return demo_build()


def rows() -> torch.Tensor:
    """Shifted ranges (the demo's data): large gradients at first, so clipping acts at every step."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 200, (ROWS, 1), generator=g) + torch.arange(SEQ)) % 256


def run_trainer(out: str) -> None:
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": r, "labels": r} for r in rows()]
    args = TrainingArguments(
        output_dir=out + ".trainer",
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=LR,
        max_grad_norm=MAX_NORM,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        train_sampling_strategy="sequential",
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=build(), args=args, train_dataset=data)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "grad_norm" in e]
    json.dump({"losses": [e["loss"] for e in logs], "grad_norms": [e["grad_norm"] for e in logs]}, open(out, "w"))


def run_shardcore(out: str) -> None:
    import shardcore

    torch.use_deterministic_algorithms(True)
    model = shardcore.shard(build(), {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    sc = shardcore.handle(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = rows()
    step_rows = PER_DEVICE * ACCUM
    losses, norms = [], []
    for s in range(STEPS):
        batch = data[s * step_rows : (s + 1) * step_rows]
        step_loss = 0.0
        micro = batch.chunk(ACCUM)
        for i, m in enumerate(micro):
            with shardcore.no_sync(model) if i < ACCUM - 1 else contextlib.nullcontext():
                loss = model(**sc.local_batch({"input_ids": m, "labels": m})).loss / ACCUM
                loss.backward()
            step_loss = step_loss + loss.detach()
        norm = shardcore.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        sc.step_end()
        losses.append(float(sc.reduce(step_loss)))
        norms.append(float(norm))
    if sc.is_main_process:
        json.dump({"losses": losses, "grad_norms": norms}, open(out, "w"))
    sc.barrier()


if __name__ == "__main__":
    {"trainer": run_trainer, "shardcore": run_shardcore}[sys.argv[1]](sys.argv[2])
