"""The Hugging Face Trainer on shardcore's XLA backends, for tests/test_trainer.py.

``python trainer_xla.py MODE OUT``, MODE ``fsdp`` (XLA FSDP: one Trainer per CPU device thread,
started by ``shardcore.launch`` as ``xmp.spawn`` would) or ``spmd`` (one controller whose batch is
the global one). The same runs as trainer_fsdp2.py's ``sharded`` mode: FULL and SHARDED configs
trained straight through (saving a checkpoint at the middle step), then each resumed from its own
middle checkpoint; each writes its final parameters (a FULL ``save_model`` loaded back with
``from_pretrained``) and its ``evaluate()`` loss and ``predict()`` logits. Also counted: the
reduce-scatters in each optimizer step's traced graph (XLA FSDP; under SPMD the partitioner inserts
the collectives when it compiles, so the traced graph holds none). Other modes: ``lora MODE OUT`` (a
PEFT model through the Trainer), ``sft MODE OUT`` (TRL's SFTTrainer with the mixin), ``best OUT``
(``load_best_model_at_end``), ``refusals OUT``, ``tp OUT`` (SPMD with tensor parallelism).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch_xla  # noqa: F401  (initialise XLA before any CPU backward)
from safetensors.torch import save_file
from trainer_fsdp2 import (
    ACCUM,
    FSDP_CONFIG,
    GLOBAL,
    STEPS,
    dataset,
    eval_dataset,
    evaluated,
    params,
    sft_report,
    sft_trainer,
    tp_runs,
    training_args,
)

# here, not in the device threads: Transformers' lazy module loading is not thread-safe
from transformers import AutoModelForCausalLM, LlamaForCausalLM, TrainerCallback  # noqa: F401

import shardcore
from shardcore.integrations.transformers import Trainer
from shardcore_conformance.models import build_model, preload
from shardcore_conformance.xla_comm import hlo_collectives

RESULTS: dict[str, dict] = {}
_LOCK = threading.Lock()


class CountReduceScatters(TrainerCallback):
    """The reduce-scatters in the step's pending graph (every micro-batch's forward and backward),
    read just before the optimizer step."""

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref
        self.per_step: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):

        model = self.trainer_ref[0].model
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
        self.per_step.append(hlo_collectives(hlo, int(os.environ["CPU_NUM_DEVICES"]))["reduce_scatter"]["count"])


class EnvironmentChanges:
    """Variables added to or removed from the process's C environment while a device function runs,
    by any thread (``os.environ`` writes through ``os.putenv`` / ``os.unsetenv``). Each moves the
    C array that libc's ``getenv`` reads without a lock in the other threads (device threads,
    device-loader threads, torch_xla's C++), which crashed the process in ``getenv``; overwriting a
    value is safe."""

    def __init__(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.getenv.restype, libc.getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
        self.changes: list[str] = []
        self.running = 0
        putenv, unsetenv = os.putenv, os.unsetenv

        def present(key) -> bool:
            return libc.getenv(os.fsencode(key)) is not None

        def _putenv(key, value):
            if self.running and not present(key):
                self.changes.append(f"{threading.current_thread().name} added {os.fsdecode(key)}")
            putenv(key, value)

        def _unsetenv(key):
            if self.running and present(key):
                self.changes.append(f"{threading.current_thread().name} removed {os.fsdecode(key)}")
            unsetenv(key)

        os.putenv, os.unsetenv = _putenv, _unsetenv

    def watching(self, fn):
        def run(*args):
            with _LOCK:
                self.running += 1
            try:
                fn(*args)
            finally:
                with _LOCK:
                    self.running -= 1

        return run


ENV = EnvironmentChanges()


def sharded_run(mode: str, root: Path, kind: str, resume: str | None = None) -> dict:
    spmd = mode == "spmd"
    out = root / f"{kind}{'-resumed' if resume else ''}"
    trainer_ref: list = []
    counter = CountReduceScatters(trainer_ref)
    world = 1 if spmd else int(os.environ["CPU_NUM_DEVICES"])
    args = training_args(
        str(out),
        GLOBAL // ACCUM // world,
        fsdp=True,
        fsdp_config={**FSDP_CONFIG, "xla": True, "xla_fsdp_v2": spmd, "state_dict_type": kind},
        save_strategy="steps",
        save_steps=STEPS // 2,
        per_device_eval_batch_size=GLOBAL // world,
    )
    trainer = Trainer(
        model=build_model("llama", 0),
        args=args,
        train_dataset=dataset(),
        callbacks=[counter],
    )
    trainer_ref.append(trainer)
    trainer.train(resume_from_checkpoint=resume)
    evaluation = evaluated(trainer)
    final = out / "final"
    trainer.save_model(str(final))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    h = shardcore.handle(trainer.model)
    if h.is_main_process:
        loaded = AutoModelForCausalLM.from_pretrained(final)  # the FULL export loads where Transformers does
        save_file(params(loaded), str(out / "params.safetensors"))
        save_file(evaluation, str(out / "eval.safetensors"))
    h.barrier()
    return {
        "reduce_scatters_per_step": counter.per_step,
        "losses": losses,
        "eval": str(out / "eval.safetensors"),
        # XLA FSDP reduce-scatters each sharded parameter's gradient on its own
        "sharded_params": sum(1 for _ in trainer.model.parameters()),
        "world_size": trainer.args.world_size,
        "params": str(out / "params.safetensors"),
        "checkpoint_files": sorted(p.name for p in (out / f"checkpoint-{STEPS // 2}").iterdir()) if not resume else [],
    }


def device_main(mode: str, out: str) -> None:
    root = Path(out).parent / mode
    report = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        report[kind] = sharded_run(mode, root, kind)
        middle = root / kind / f"checkpoint-{STEPS // 2}"
        report[kind + "-resumed"] = sharded_run(mode, root, kind, resume=str(middle))
    import torch_xla.runtime as xr

    with _LOCK:
        RESULTS[str(0 if mode == "spmd" else xr.global_ordinal())] = report


def tp_main(out: str) -> None:
    """SPMD with ``TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2))`` on the
    process's CPU devices (``tp_size`` 2 over pairs of them, :func:`trainer_fsdp2.tp_runs`). One
    process reads the whole global batch."""
    dp = int(os.environ["CPU_NUM_DEVICES"]) // 2
    report = tp_runs(Path(out).parent / "spmd-tp", dp, GLOBAL // ACCUM, xla=True, xla_fsdp_v2=True)
    json.dump(report, open(out, "w"), indent=1)


def lora_main(mode: str, out: str) -> None:
    """A PEFT model (the suite's llama_lora) handed to the Trainer: trained, then ``save_model`` writes
    the adapter directory; device 0 loads it with PEFT onto a fresh base and writes the adapter's
    weights."""
    from peft import PeftModel

    from shardcore_conformance.models import lora_base

    spmd = mode == "spmd"
    world = 1 if spmd else int(os.environ["CPU_NUM_DEVICES"])
    root = Path(out).parent / f"lora-{mode}"
    args = training_args(
        str(root),
        GLOBAL // ACCUM // world,
        fsdp=True,
        fsdp_config={**FSDP_CONFIG, "xla": True, "xla_fsdp_v2": spmd},
        save_strategy="no",
    )
    trainer = Trainer(model=build_model("llama_lora", 0), args=args, train_dataset=dataset())
    trainer.train()
    trainer.save_model(str(root / "adapter"))
    h = shardcore.handle(trainer.model)
    if h.is_main_process:
        loaded = PeftModel.from_pretrained(lora_base("llama"), str(root / "adapter"))
        save_file({k: v for k, v in params(loaded).items() if "lora_" in k}, out + ".adapter.safetensors")
        files = sorted(p.name for p in (root / "adapter").iterdir())
        json.dump({"adapter_files": files, "adapter": out + ".adapter.safetensors"}, open(out, "w"))
    h.barrier()


def best_main(out: str) -> None:
    """``load_best_model_at_end`` with an evaluation at each checkpoint, the best being the first
    (``greater_is_better`` on the loss): the trained model ends with checkpoint-2's weights."""
    from safetensors.torch import load_file

    world = int(os.environ["CPU_NUM_DEVICES"])
    root = Path(out).parent / "best"
    args = training_args(
        str(root),
        GLOBAL // ACCUM // world,
        fsdp=True,
        fsdp_config={**FSDP_CONFIG, "xla": True},
        save_strategy="steps",
        save_steps=STEPS // 2,
        eval_strategy="steps",
        eval_steps=STEPS // 2,
        per_device_eval_batch_size=GLOBAL // world,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
    )
    trainer = Trainer(model=build_model("llama", 0), args=args, train_dataset=dataset(), eval_dataset=eval_dataset())
    trainer.train()
    h = shardcore.handle(trainer.model)
    full = h.backend.full_state_dict(trainer.model)
    if h.is_main_process:
        best = load_file(str(root / f"checkpoint-{STEPS // 2}" / "model.safetensors"))
        state = json.load(open(root / f"checkpoint-{STEPS}" / "trainer_state.json"))
        json.dump(
            {
                "best_model_checkpoint": trainer.state.best_model_checkpoint,
                "saved_best_global_step": state["best_global_step"],
                "saved_best_model_checkpoint": state["best_model_checkpoint"],
                "diff_to_best": max(float((full[k] - v).abs().max()) for k, v in best.items()),
            },
            open(out, "w"),
        )
    h.barrier()


def sft_main(mode: str, out: str) -> None:
    """TRL's SFTTrainer with the mixin and a LoRA peft_config (trainer_fsdp2.sft_trainer) on XLA FSDP's
    device threads or under SPMD, in fp32 without the Trainer's checkpointing (SFTConfig's defaults are
    refused on XLA); device 0 writes the loss log and what PEFT loads from the adapter."""
    spmd = mode == "spmd"
    root = Path(out).parent / f"sft-{mode}"
    world = 1 if spmd else int(os.environ["CPU_NUM_DEVICES"])
    config = {**FSDP_CONFIG, "xla": True, "xla_fsdp_v2": spmd}
    trainer = sft_trainer(root, world, config, optim="adamw_torch", bf16=False, gradient_checkpointing=False)
    trainer.train()
    trainer.save_model(str(root / "adapter"))
    h = shardcore.handle(trainer.model)
    if h.is_main_process:
        json.dump(sft_report(trainer, root / "adapter"), open(out, "w"))
    h.barrier()


def sft_with_defaults(out: str) -> None:
    """TRL's SFTTrainer with the mixin and SFTConfig's defaults (bf16 and gradient checkpointing on)."""
    from datasets import Dataset
    from trainer_fsdp2 import tokenizer
    from trl import SFTConfig, SFTTrainer

    from shardcore.integrations.transformers import ShardcoreTrainerMixin

    class ShardcoreSFTTrainer(ShardcoreTrainerMixin, SFTTrainer):
        pass

    args = SFTConfig(output_dir=out + ".sft", report_to=[], optim="adamw_torch", fsdp=True, fsdp_config={"xla": True})
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4})
    ShardcoreSFTTrainer(model=build_model("llama", 0), args=args, train_dataset=data, processing_class=tokenizer())


def refusals(out: str) -> None:
    """What this Trainer refuses on XLA, each as (key, message): the fsdp2 backend where Transformers
    sees torch_xla; SPMD where the runtime was not in SPMD mode before TrainingArguments; weight decay
    on a model sharded (renamed) before the Trainer."""
    got = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            got[name] = None
        except shardcore.ShardConfigError as e:
            got[name] = [e.key, str(e)]

    def trainer(model, **kw):
        return Trainer(model=model, args=training_args(out + ".out", 2, **kw), train_dataset=dataset())

    attempt("fsdp2", lambda: trainer(build_model("llama", 0), fsdp=True, fsdp_config=FSDP_CONFIG))
    attempt("spmd", lambda: trainer(build_model("llama", 0), fsdp=True, fsdp_config={"xla": True, "xla_fsdp_v2": True}))
    # refused when the Trainer is created: the XLA backends take no mixed_precision, and the Trainer's
    # torch.utils.checkpoint fails on an XLA device in the first forward
    attempt("bf16", lambda: trainer(build_model("llama", 0), fsdp=True, fsdp_config={"xla": True}, bf16=True))
    attempt(
        "activation_checkpointing",
        lambda: trainer(build_model("llama", 0), fsdp=True, fsdp_config={"xla": True}, gradient_checkpointing=True),
    )
    attempt("sft_defaults", lambda: sft_with_defaults(out))

    def presharded() -> None:
        model = shardcore.shard(build_model("llama", 0), {**FSDP_CONFIG, "xla": True})
        attempt("weight_decay", lambda: trainer(model).train())

    shardcore.launch(presharded, {"xla": True})
    json.dump(got, open(out, "w"), indent=1)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    # the plain Trainer's initial weights, built here once: device threads share one global RNG, and
    # one thread's Trainer seeding it (set_seed) while another builds its model changed device 0's
    # weights, which XLA FSDP gives every device (seen in one CI run: 9e-2 off the plain Trainer)
    preload({("llama", 0): build_model("llama", 0).state_dict()})
    if mode == "refusals":
        refusals(out)
        sys.exit(0)
    if mode == "best":
        shardcore.launch(best_main, {"xla": True}, args=(out,))
        sys.exit(0)
    if mode == "sft":
        import trl  # noqa: F401  (here, not in the device threads: lazy module loading is not thread-safe)

        kind, out = sys.argv[2], sys.argv[3]
        shardcore.launch(sft_main, {"xla": True, "xla_fsdp_v2": kind == "spmd"}, args=(kind, out))
        sys.exit(0)
    if mode == "tp":
        shardcore.launch(tp_main, {"xla": True, "xla_fsdp_v2": True}, args=(out,))
        sys.exit(0)
    if mode == "lora":
        kind, out = sys.argv[2], sys.argv[3]
        preload({("llama_lora", 0): build_model("llama_lora", 0).state_dict()})
        shardcore.launch(lora_main, {"xla": True, "xla_fsdp_v2": kind == "spmd"}, args=(kind, out))
        sys.exit(0)
    shardcore.launch(ENV.watching(device_main), {"xla": True, "xla_fsdp_v2": mode == "spmd"}, args=(mode, out))
    json.dump({**RESULTS["0"], "environment_changes": ENV.changes}, open(out, "w"), indent=1)
