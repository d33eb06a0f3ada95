"""The Hugging Face Trainer on shardcore (``shardcore.integrations.transformers.Trainer``), for
tests/test_trainer.py.

``reference OUT``: ``transformers.Trainer`` on one process, the whole global batch per device.
``sharded OUT``: the shardcore Trainer on the ranks torchrun started, ``fsdp=True`` with the
fsdp_config below, per-device batch = global / world size. Four runs in one launch: FULL and SHARDED
configs trained straight through (each saving a checkpoint at the middle step; SHARDED once more with
``async_save``), then each resumed
from its own middle checkpoint. Every run writes its final parameters (a FULL save_model, loaded
back with from_pretrained) and the reduce-scatters counted per optimizer step.
``sft OUT``: TRL's SFTTrainer with ShardcoreTrainerMixin on the ranks, a LoRA adapter; writes the
loss log and what PEFT loads from the adapter directory save_model wrote. ``sft-reference OUT``: the
same with TRL's own SFTTrainer on one process, in fp32 (trainer_xla.py's ``sft`` compares with it).

Both sides get the same initial weights (one seed), the same global batches in the same order
(sequential sampler; accelerate deals each rank its consecutive per-device slice of them), AdamW with
the suite's eps, clipping at 1.0 and 2 accumulation steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from shardcore_conformance.models import MODELS, build_model
from shardcore_conformance.train import ADAM_EPS

ROWS, SEQ, STEPS, GLOBAL, ACCUM = 32, 16, 4, 8, 2
LR, MAX_NORM = 1e-2, 0.5  # the gradient norms here are 0.8 to 0.9: clipping acts at every step
FSDP_CONFIG = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True}


def dataset(vocab: int = 97) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=g)  # the llama case's vocabulary
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def training_args(out: str, per_device: int, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=LR,
        max_grad_norm=MAX_NORM,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.01,
        adam_epsilon=ADAM_EPS,
        optim="adamw_torch",
        logging_steps=1,
        report_to=[],
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        seed=0,
        disable_tqdm=True,
        **kw,
    )


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def eval_dataset(vocab: int = 97) -> list[dict[str, torch.Tensor]]:
    return dataset(vocab)[:GLOBAL]


def evaluated(trainer, vocab: int = 97) -> dict[str, torch.Tensor]:
    """The trained model's evaluation loss and predicted logits (``evaluate()``, ``predict()``)."""
    metrics = trainer.evaluate(eval_dataset(vocab))
    logits = torch.as_tensor(trainer.predict(eval_dataset(vocab)).predictions)
    return {"eval_loss": torch.tensor(metrics["eval_loss"]), "logits": logits}


def run_reference(out: str, model: str = "llama") -> None:
    """The plain Trainer's final parameters in ``out``, its evaluation in ``out.eval.safetensors``.
    ``model`` is a conformance model name (``llama_lora``: a PEFT model)."""
    from transformers import Trainer

    args = training_args(
        out + ".ref", GLOBAL // ACCUM, use_cpu=True, save_strategy="no", per_device_eval_batch_size=GLOBAL
    )
    vocab = MODELS[model].vocab
    trainer = Trainer(model=build_model(model, 0), args=args, train_dataset=dataset(vocab))
    trainer.train()
    save_file(params(trainer.model), out)
    save_file(evaluated(trainer, vocab), out + ".eval.safetensors")
    json.dump(logged(trainer), open(out + ".log.json", "w"))


def logged(trainer) -> dict[str, list[float]]:
    """Each optimizer step's logged loss and gradient norm (before clipping)."""
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    return {"losses": [e["loss"] for e in steps], "grad_norms": [e["grad_norm"] for e in steps]}


class Counter:
    """Counts torch.distributed's reduce-scatters (what FSDP2 reduces gradients with)."""

    def __init__(self):
        self.calls = 0
        for name in ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"):
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self.wrap(fn))

    def wrap(self, fn):
        def counted(*a, **kw):
            self.calls += 1
            return fn(*a, **kw)

        return counted


#: the runs of ``sharded``: each name's fsdp_config on top of FSDP_CONFIG
RUNS = {
    "FULL_STATE_DICT": {"state_dict_type": "FULL_STATE_DICT"},
    "SHARDED_STATE_DICT": {"state_dict_type": "SHARDED_STATE_DICT"},
    "SHARDED_STATE_DICT-async": {"state_dict_type": "SHARDED_STATE_DICT", "async_save": True},
}


def sharded_run(root: Path, kind: str, counter: Counter, resume: str | None = None) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, TrainerCallback

    from shardcore.integrations.transformers import Trainer

    per_step: list[int] = []

    class CountPerStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = counter.calls

        def on_step_end(self, args, state, control, **kwargs):
            per_step.append(counter.calls - self.start)

    world = int(os.environ["WORLD_SIZE"])
    out = root / f"{kind}{'-resumed' if resume else ''}"
    args = training_args(
        str(out),
        GLOBAL // ACCUM // world,
        use_cpu=True,  # on a machine without GPUs accelerate is multi-process only with it (as for DDP)
        fsdp=True,
        fsdp_config={**FSDP_CONFIG, **RUNS[kind]},
        save_strategy="steps",
        save_steps=STEPS // 2,
        per_device_eval_batch_size=GLOBAL // world,
    )
    trainer = Trainer(model=build_model("llama", 0), args=args, train_dataset=dataset(), callbacks=[CountPerStep()])
    trainer.train(resume_from_checkpoint=resume)
    units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    evaluation = evaluated(trainer)
    final = out / "final"
    trainer.save_model(str(final))
    loaded = AutoModelForCausalLM.from_pretrained(final)  # the FULL export loads where Transformers does
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    if dist.get_rank() == 0:
        save_file(params(loaded), str(out / "params.safetensors"))
        save_file(evaluation, str(out / "eval.safetensors"))
    return {
        "units": units,
        "reduce_scatters_per_step": per_step,
        "losses": losses,
        "params": str(out / "params.safetensors"),
        "eval": str(out / "eval.safetensors"),
    }


def run_sharded(out: str) -> None:
    counter = Counter()
    root = Path(out).parent
    report = {}
    for kind in RUNS:
        report[kind] = sharded_run(root, kind, counter)
        middle = root / kind / f"checkpoint-{STEPS // 2}"
        report[kind + "-resumed"] = sharded_run(root, kind, counter, resume=str(middle))
        report[kind]["checkpoint_files"] = sorted(p.name for p in middle.iterdir())
    if dist.get_rank() == 0:
        json.dump(report, open(out, "w"), indent=1)
    dist.barrier()


def run_tp(out: str) -> None:
    """The shardcore Trainer with ``TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2))``:
    dp_shard world/2 x tp 2 (:func:`tp_runs`)."""
    dp = int(os.environ["WORLD_SIZE"]) // 2
    # each data-parallel group's rows: both ranks of a tp pair get the same
    report = tp_runs(Path(out).parent / "tp", dp, GLOBAL // ACCUM // dp, use_cpu=True)
    if dist.get_rank() == 0:
        json.dump(report, open(out, "w"), indent=1)
    dist.barrier()


def tp_runs(root: Path, dp: int, per_device: int, **fsdp_config) -> dict:
    """``ParallelismConfig(dp_shard_size=dp, tp_size=2)`` on the Llama with a vocabulary tp splits
    (its own plan), SHARDED checkpoints, trained straight and resumed from the middle one. Each run:
    its final FULL export loaded with from_pretrained, its loss log and its evaluation (rank 0 writes
    them). ``fsdp_config``: more keys, and ``use_cpu``, for TrainingArguments."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import AutoModelForCausalLM

    import shardcore
    from shardcore.integrations.transformers import Trainer

    use_cpu = fsdp_config.pop("use_cpu", False)
    vocab = MODELS["llama_tp"].vocab
    report = {}
    for name, resume in (("straight", None), ("resumed", str(root / f"checkpoint-{STEPS // 2}"))):
        args = training_args(
            str(root),
            per_device,
            use_cpu=use_cpu,
            fsdp=True,
            fsdp_config={**FSDP_CONFIG, "state_dict_type": "SHARDED_STATE_DICT", **fsdp_config},
            parallelism_config=ParallelismConfig(dp_shard_size=dp, tp_size=2),
            save_strategy="steps",
            save_steps=STEPS // 2,
            per_device_eval_batch_size=per_device * ACCUM,
        )
        trainer = Trainer(model=build_model("llama_tp", 0), args=args, train_dataset=dataset(vocab))
        trainer.train(resume_from_checkpoint=resume)
        evaluation = evaluated(trainer, vocab)
        final = root / f"final-{name}"
        trainer.save_model(str(final))
        loaded = AutoModelForCausalLM.from_pretrained(final)
        if not dist.is_initialized() or dist.get_rank() == 0:  # SPMD: one process
            save_file(params(loaded), str(final / "params.safetensors"))
            save_file(evaluation, str(final / "eval.safetensors"))
        report[name] = {
            **logged(trainer),
            "params": str(final / "params.safetensors"),
            "eval": str(final / "eval.safetensors"),
            "tp_size": shardcore.handle(trainer.model).config.tp_size,
            "tp_processes": trainer.get_tp_size(),
        }
    return report


def tokenizer():
    """A word-level tokenizer over the llama case's 97 ids, built here (nothing is downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(97)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))
    tok.pad_token, tok.eos_token = "t0", "t1"
    return tok


def sft_trainer(root: Path, world: int, fsdp_config: dict | None, plain: bool = False, **kw):
    """TRL's SFTTrainer over the suite's rows with a LoRA ``peft_config``: with the mixin, sharded with
    ``fsdp_config`` over ``world`` ranks (the global batch the same at every world size), or, with
    ``plain``, TRL's own class on one process."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from shardcore.integrations.transformers import ShardcoreTrainerMixin

    class ShardcoreSFTTrainer(ShardcoreTrainerMixin, SFTTrainer):
        pass

    ids = torch.randint(0, 97, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))
    args = SFTConfig(
        output_dir=str(root),
        per_device_train_batch_size=GLOBAL // ACCUM // world,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=MAX_NORM,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **({"fsdp": True, "fsdp_config": fsdp_config} if fsdp_config is not None else {}),
        **kw,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return (SFTTrainer if plain else ShardcoreSFTTrainer)(
        model=build_model("llama", 0),
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
        processing_class=tokenizer(),
        peft_config=lora,
    )


def sft_report(trainer, adapter: Path) -> dict:
    """What an SFT run is checked by: its logged losses, the files of its adapter directory, and the
    largest LoRA B weight PEFT loads from it onto a fresh base (B starts at zero: nonzero is training)."""
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(build_model("llama", 0), str(adapter))
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e],
        "adapter_files": sorted(p.name for p in adapter.iterdir()),
        "lora_b_max": max(float(p.abs().max()) for n, p in loaded.named_parameters() if "lora_B" in n),
    }


def run_sft(out: str) -> None:
    """TRL's SFTTrainer with the mixin, a LoRA adapter (peft_config), 2 FSDP2 ranks, SFTConfig's
    defaults (bf16, gradient checkpointing): it trains, logs the mean loss, and save_model writes the
    adapter directory."""
    from peft import PeftModel

    root = Path(out).parent / "sft"
    trainer = sft_trainer(root, int(os.environ["WORLD_SIZE"]), FSDP_CONFIG, use_cpu=True)
    assert isinstance(trainer.model, PeftModel), type(trainer.model)
    trainer.train()
    trainer.save_model(str(root / "adapter"))
    if dist.get_rank() == 0:
        json.dump(sft_report(trainer, root / "adapter"), open(out, "w"))
    dist.barrier()


def run_sft_reference(out: str) -> None:
    """TRL's own SFTTrainer on one process, in fp32 (the XLA backends take no bf16)."""
    root = Path(out).parent / "sft-reference"
    trainer = sft_trainer(root, 1, None, plain=True, use_cpu=True, bf16=False)
    trainer.train()
    trainer.save_model(str(root / "adapter"))
    json.dump(sft_report(trainer, root / "adapter"), open(out, "w"))


if __name__ == "__main__":
    modes = {
        "reference": run_reference,
        "sharded": run_sharded,
        "tp": run_tp,
        "sft": run_sft,
        "sft-reference": run_sft_reference,
    }
    modes[sys.argv[1]](*sys.argv[2:])
