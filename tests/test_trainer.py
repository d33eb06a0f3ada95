"""The Hugging Face Trainer through shardcore (``shardcore.integrations.transformers``): the mode it
picks, what it refuses, and on real ranks its parity with ``transformers.Trainer``, its gradient
reductions under accumulation, and resuming in both checkpoint formats."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardcore
from shardcore.errors import ShardConfigError
from shardcore_conformance.compare import TOLERANCES

import harness

pytest.importorskip("transformers")

#: conformance/shardcore_conformance/compare.py TOLERANCES["fp32"]
PARAM_ATOL = TOLERANCES["fp32"].param_atol
LOSS_ATOL, LOSS_RTOL = TOLERANCES["fp32"].loss_atol, TOLERANCES["fp32"].loss_rtol
OUTPUT_ATOL = TOLERANCES["fp32"].output_atol


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], disable_tqdm=True, **kw)


def _data():
    ids = torch.randint(0, 97, (8, 8), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


# -- in process ---------------------------------------------------------------------------------


def test_without_fsdp_it_is_the_plain_trainer(tmp_path, tiny_llama):
    import transformers

    from shardcore.integrations.transformers import Trainer

    trainer = Trainer(model=tiny_llama, args=_args(tmp_path, use_cpu=True, max_steps=1), train_dataset=_data())
    assert isinstance(trainer, transformers.Trainer)
    assert trainer._shardcore_config is None
    trainer.train()
    assert shardcore.api.handle_or_none(trainer.model) is None  # never sharded


def test_a_model_sharded_before_the_trainer_trains_and_saves_full(tmp_path, tiny_llama):
    """World of one, in process: the pre-sharded path (the crash the issue starts from is this model
    handed to a plain Trainer under torchrun)."""
    from transformers import AutoModelForCausalLM

    from shardcore.integrations.transformers import Trainer

    model = shardcore.shard(tiny_llama, {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    trainer.train()
    assert trainer.model is model and shardcore.handle(model).backend.name == "fsdp2"
    trainer.save_model()  # into the output directory beside checkpoint-1, checkpoint-2
    out = tmp_path / "out"
    assert {"checkpoint-1", "checkpoint-2", "model.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
    assert (out / "checkpoint-2" / "shardcore.json").is_file() and (out / "checkpoint-2" / "scheduler.pt").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    full = shardcore.handle(model).backend.full_state_dict(model)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, full[k]), k


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_total_limit_rotates_complete_checkpoints_and_true_resumes_the_newest_complete(
    tmp_path, tiny_llama, monkeypatch, caplog, async_save
):
    """The Trainer's rotation and ``resume_from_checkpoint=True`` count only checkpoints whose save
    finished: a partial ``checkpoint-<N>`` is never resumed, a directory shardcore did not write is
    never deleted, and a save that dies deletes nothing. The run resumed after the crash ends where an
    uninterrupted one does. With ``async_save`` each checkpoint is written in the background."""
    import copy
    import logging

    import transformers

    from shardcore.checkpoint import manager
    from shardcore.checkpoint.manager import STEP_MARKER
    from shardcore.integrations.transformers import Trainer

    backgrounds = []
    real_background = manager.Background

    def counted(step, *a):
        backgrounds.append(step)
        return real_background(step, *a)

    monkeypatch.setattr(manager, "Background", counted)

    out = tmp_path / "out"
    (out / "checkpoint-100").mkdir(parents=True)  # the user's own, named like a checkpoint
    (out / "checkpoint-100" / "notes.txt").write_text("mine")
    (out / "checkpoint-50").mkdir()  # a save that died before its marker
    (out / "checkpoint-50" / "trainer_state.json").write_text("{}")
    initial = copy.deepcopy(tiny_llama.state_dict())

    def trainer(steps, directory=out):
        tiny_llama.load_state_dict(initial)
        config = {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "async_save": async_save}
        model = shardcore.shard(copy.deepcopy(tiny_llama), config)
        args = transformers.TrainingArguments(
            output_dir=str(directory),
            report_to=[],
            disable_tqdm=True,
            max_steps=steps,
            per_device_train_batch_size=2,
            save_strategy="steps",
            save_steps=1,
            save_total_limit=2,
            seed=0,
        )
        return Trainer(model=model, args=args, train_dataset=_data())

    def listing(hidden=True):
        prefixes = (".", "checkpoint") if hidden else ("checkpoint",)
        return sorted(p.name for p in out.iterdir() if p.name.startswith(prefixes))

    def params(t):
        return {k: v.clone() for k, v in shardcore.handle(t.model).backend.full_state_dict(t.model).items()}

    straight = trainer(4, tmp_path / "straight")
    straight.train()
    want = params(straight)
    assert backgrounds == ([1, 2, 3, 4] if async_save else [])

    # the save of step 3 dies after the model is written, before its marker: nothing is deleted
    def dies(self, output_dir):
        if self.state.global_step == 3:
            raise OSError(28, "No space left on device (injected)")
        return original(self, output_dir)

    original = transformers.Trainer._save_rng_state
    monkeypatch.setattr(transformers.Trainer, "_save_rng_state", dies)
    with pytest.raises(OSError, match="injected"):
        trainer(4).train()
    monkeypatch.setattr(transformers.Trainer, "_save_rng_state", original)
    # (an async save's staging directory stays hidden until the next save of the step)
    assert listing(hidden=False) == ["checkpoint-1", "checkpoint-100", "checkpoint-2", "checkpoint-3", "checkpoint-50"]
    assert (out / "checkpoint-2" / STEP_MARKER).is_file() and not (out / "checkpoint-3" / STEP_MARKER).exists()

    resumed = trainer(4)
    with caplog.at_level(logging.INFO, logger="shardcore"):
        resumed.train(resume_from_checkpoint=True)
    assert f"resuming from {out / 'checkpoint-2'}," in caplog.text  # not the partial checkpoint-3
    for partial in ("checkpoint-3", "checkpoint-50", "checkpoint-100"):
        assert f"not resuming from {out / partial}:" in caplog.text
    # checkpoint-3 saved again and marked; the user's directories untouched, no leftovers
    assert listing() == ["checkpoint-100", "checkpoint-3", "checkpoint-4", "checkpoint-50"]
    assert (out / "checkpoint-100" / "notes.txt").read_text() == "mine"
    got = params(resumed)
    for k, v in want.items():
        assert torch.equal(got[k], v), k

    with pytest.raises(shardcore.errors.CheckpointError, match="resume_from_checkpoint=True: .* holds no complete"):
        trainer(1, tmp_path / "empty").train(resume_from_checkpoint=True)


def test_fsdp_with_a_presharded_model_is_refused(tmp_path, tiny_llama):
    from shardcore.integrations.transformers import Trainer

    model = shardcore.shard(tiny_llama, {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    with pytest.raises(ShardConfigError, match="'fsdp'.*already sharded") as e:
        Trainer(model=model, args=_args(tmp_path, fsdp=True), train_dataset=_data())
    assert e.value.key == "fsdp"


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"ddp_find_unused_parameters": True}, "ddp_find_unused_parameters"),
        ({"ddp_bucket_cap_mb": 25}, "ddp_bucket_cap_mb"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"fsdp_config": {"xla": True}}, "xla"),
        ({"fsdp_config": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "no_such_key": 1}}, "no_such_key"),
        (
            {"fsdp_config": {"activation_checkpointing": True}, "gradient_checkpointing": True},
            "activation_checkpointing",
        ),
    ],
)
def test_trainer_arguments_that_cannot_apply_are_refused(tmp_path, tiny_llama, kw, key):
    from shardcore.integrations.transformers import Trainer

    kw = {"fsdp": True, **kw}
    with pytest.raises(ShardConfigError) as e:
        Trainer(model=tiny_llama, args=_args(tmp_path, **kw), train_dataset=_data())
    assert e.value.key == key, e.value


def test_deepspeed_is_refused(tmp_path, tiny_llama, monkeypatch):
    """A DeepSpeed config with fsdp: DeepSpeed is not installed here, so the arguments object says it
    is set the way TrainingArguments records it (``deepspeed`` holds the config)."""
    from shardcore.integrations.transformers import Trainer

    args = _args(tmp_path, fsdp=True)
    monkeypatch.setattr(args, "deepspeed", {"zero_optimization": {"stage": 3}})
    with pytest.raises(ShardConfigError, match="'deepspeed'.*DeepSpeed would shard") as e:
        Trainer(model=tiny_llama, args=args, train_dataset=_data())
    assert e.value.key == "deepspeed"


def test_optimizers_built_before_sharding_are_refused(tmp_path, tiny_llama, monkeypatch):
    from transformers import TrainingArguments
    from transformers.training_args import ParallelMode

    from shardcore.integrations.transformers import Trainer

    # past the Trainer's own "fsdp only works in distributed training", as under torchrun
    monkeypatch.setattr(TrainingArguments, "parallel_mode", property(lambda self: ParallelMode.DISTRIBUTED))
    opt = torch.optim.AdamW(tiny_llama.parameters())
    with pytest.raises(ShardConfigError, match="'optimizers'") as e:
        Trainer(model=tiny_llama, args=_args(tmp_path, fsdp=True), train_dataset=_data(), optimizers=(opt, None))
    assert e.value.key == "optimizers"


def test_the_mixin_keeps_trainer_flags_false_in_shardcore_mode():
    from shardcore.integrations.transformers import ShardcoreTrainerMixin

    class T(ShardcoreTrainerMixin):
        pass

    t = T()
    t.is_fsdp_xla_v2_enabled = True
    assert t.is_fsdp_xla_v2_enabled is True  # plain Trainer: its own value
    t._shardcore_config = shardcore.parse_config({})
    assert t.is_fsdp_xla_v2_enabled is False  # shardcore's backend does the SPMD work


# -- real ranks ---------------------------------------------------------------------------------


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_accelerates_clear_environment_clears_for_its_own_thread_and_leaves_the_c_environment():
    """What the Trainer wraps its Accelerator's creation in: accelerate's ``clear_environment`` (run by
    the accumulation plugin's ``to_kwargs``) empties ``os.environ`` for the clearing thread only, never
    unsets a variable of the C environment (whose array libc's getenv reads unlocked in other threads)
    and undoes what it wrote inside; another thread's call gets accelerate's own; and the original is
    back afterwards. ``to_kwargs`` gives what it gives upstream."""
    import ctypes
    import os
    import threading

    from accelerate.utils import GradientAccumulationPlugin, environment

    from shardcore.integrations._environ import thread_scoped_clear_environment

    libc = ctypes.CDLL(None)
    libc.getenv.restype, libc.getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    original = environment.clear_environment
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    upstream = plugin.to_kwargs()
    array = ctypes.c_void_p.in_dll(libc, "environ").value
    seen: dict = {}

    def elsewhere() -> None:
        seen["other thread"] = os.environ.get("PATH")
        seen["other thread's clear"] = environment.clear_environment().func is original.__wrapped__

    with thread_scoped_clear_environment():
        assert plugin.to_kwargs() == upstream
        with environment.clear_environment():
            seen["inside"] = dict(os.environ)
            seen["C inside"] = libc.getenv(b"PATH")
            t = threading.Thread(target=elsewhere)
            t.start()
            t.join()
            seen["array"] = ctypes.c_void_p.in_dll(libc, "environ").value
            os.environ["SHARDCORE_WRITTEN_WHILE_CLEARED"] = "1"
    assert seen["inside"] == {}
    assert seen["C inside"] == os.environ["PATH"].encode() and seen["array"] == array
    assert seen["other thread"] == os.environ["PATH"] and seen["other thread's clear"]
    assert (
        "SHARDCORE_WRITTEN_WHILE_CLEARED" not in os.environ and libc.getenv(b"SHARDCORE_WRITTEN_WHILE_CLEARED") is None
    )
    assert environment.clear_environment is original


@pytest.fixture(scope="module")
def plain_trainer(tmp_path_factory):
    """transformers.Trainer on one process: final parameters, evaluation loss and predicted logits."""
    ref = tmp_path_factory.mktemp("plain") / "ref.safetensors"
    out = harness.python(harness.worker("trainer_fsdp2"), "reference", str(ref), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    return load_file(ref), load_file(str(ref) + ".eval.safetensors")


def _check_against_plain(report: dict, plain, backend: str) -> None:
    """Each run's final parameters within param_atol of the plain Trainer's, its evaluation loss
    within the loss tolerance and its predicted logits within output_atol; each resumed run's
    parameters and loss log exactly the uninterrupted run's; FULL and SHARDED runs identical."""
    reference, ref_eval = plain
    straight = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        run = report[kind]
        straight[kind] = load_file(run["params"])
        diff = _max_diff(straight[kind], reference)
        got = load_file(run["eval"])
        eval_diff = abs(float(got["eval_loss"]) - float(ref_eval["eval_loss"]))
        logits_diff = float((got["logits"] - ref_eval["logits"]).abs().max())
        print(
            f"{backend} {kind}: max |param - plain Trainer| = {diff:.3e}; |eval_loss diff| = {eval_diff:.3e}; "
            f"max |logits diff| = {logits_diff:.3e}; reduce-scatters per step {run['reduce_scatters_per_step']}"
        )
        assert diff <= PARAM_ATOL, (kind, diff)
        assert eval_diff <= LOSS_ATOL + LOSS_RTOL * abs(float(ref_eval["eval_loss"])), (kind, eval_diff)
        assert got["logits"].shape == ref_eval["logits"].shape, (got["logits"].shape, ref_eval["logits"].shape)
        assert logits_diff <= OUTPUT_ATOL, (kind, logits_diff)
        resumed = report[kind + "-resumed"]
        rdiff = _max_diff(load_file(resumed["params"]), straight[kind])
        print(f"{backend} {kind}: resumed from checkpoint-2, max |param - uninterrupted| = {rdiff:.3e}")
        assert rdiff == 0.0, (kind, rdiff)
        # the log history comes back with trainer_state.json: steps 1-2 from it, 3-4 trained again
        assert resumed["losses"] == run["losses"], (resumed["losses"], run["losses"])
    assert "model.safetensors" in report["FULL_STATE_DICT"]["checkpoint_files"]
    assert "scheduler.pt" in report["SHARDED_STATE_DICT"]["checkpoint_files"]
    assert _max_diff(straight["FULL_STATE_DICT"], straight["SHARDED_STATE_DICT"]) == 0.0
    asynchronous = report.get("SHARDED_STATE_DICT-async")
    if asynchronous is not None:  # the FSDP2 worker's: written in the background, the same numbers
        assert _max_diff(load_file(asynchronous["params"]), straight["SHARDED_STATE_DICT"]) == 0.0
        resumed = load_file(report["SHARDED_STATE_DICT-async-resumed"]["params"])
        assert _max_diff(resumed, straight["SHARDED_STATE_DICT"]) == 0.0
        assert asynchronous["checkpoint_files"] == report["SHARDED_STATE_DICT"]["checkpoint_files"]
        assert "shardcore-step.json" in asynchronous["checkpoint_files"]


@pytest.mark.multiprocess
def test_fsdp2_trainer_matches_the_plain_trainer_and_resumes(tmp_path, plain_trainer):
    """transformers.Trainer on one process vs this Trainer on 2 FSDP2 ranks, the same global batches,
    clipping at every step, 2 accumulation steps: final parameters within the suite's fp32 param_atol.
    With accumulation, one reduce-scatter per FSDP unit per optimizer step. Resumed from the middle
    checkpoint, FULL and SHARDED, the parameters are the uninterrupted run's."""
    worker = harness.worker("trainer_fsdp2")
    report_path = tmp_path / "report.json"
    out = harness.ranks(2, worker, "sharded", str(report_path), timeout=420)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    report = json.loads(report_path.read_text())
    _check_against_plain(report, plain_trainer, "fsdp2")
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "SHARDED_STATE_DICT-async"):
        run, resumed = report[kind], report[kind + "-resumed"]
        # one reduce-scatter per unit per optimizer step, not one per micro-batch
        assert run["units"] == 3  # 2 decoder layers and the root
        assert run["reduce_scatters_per_step"] == [run["units"]] * 4, run
        assert resumed["reduce_scatters_per_step"] == [run["units"]] * 2, resumed


@pytest.mark.multiprocess
def test_trainer_with_tensor_parallelism_matches_the_plain_trainer_and_resumes(tmp_path):
    """``TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))`` on 4
    ranks: each step's logged loss and gradient norm (before clipping, so a gradient scaled by the
    tp size would show), the final parameters, the evaluation loss and the predicted logits are the
    plain Trainer's on one process; resumed from the middle SHARDED checkpoint it ends where the
    uninterrupted run did; its FULL export loads with from_pretrained. Then the same against SPMD with
    ``ParallelismConfig(tp_size=2)`` on 2 CPU PJRT devices."""
    ref = tmp_path / "ref.safetensors"
    out = harness.python(harness.worker("trainer_fsdp2"), "reference", str(ref), "llama_tp", timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    reference, ref_eval = load_file(ref), load_file(str(ref) + ".eval.safetensors")
    ref_log = json.loads(Path(str(ref) + ".log.json").read_text())
    report_path = tmp_path / "report.json"
    out = harness.ranks(4, harness.worker("trainer_fsdp2"), "tp", str(report_path), timeout=420)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    _check_tp_trainer(json.loads(report_path.read_text()), reference, ref_eval, ref_log, "fsdp2", processes=2)
    # SPMD on 2 CPU devices, tp_size 2: one process, which the Trainer's sizes count as its tp group
    pytest.importorskip("torch_xla")
    spmd = tmp_path / "spmd" / "report.json"
    spmd.parent.mkdir()
    out = harness.python(harness.worker("trainer_xla"), "tp", str(spmd), env=harness.xla_env(2), timeout=420)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    _check_tp_trainer(json.loads(spmd.read_text()), reference, ref_eval, ref_log, "spmd", processes=1)


def _check_tp_trainer(report, reference, ref_eval, ref_log, backend: str, processes: int) -> None:
    straight = load_file(report["straight"]["params"])
    for name in ("straight", "resumed"):
        run = report[name]
        assert run["tp_size"] == 2 and run["tp_processes"] == processes, (backend, run)
        for key in ("losses", "grad_norms"):
            for a, b in zip(run[key], ref_log[key], strict=True):
                assert abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b), (name, key, run[key], ref_log[key])
        params = load_file(run["params"])
        diff = _max_diff(params, reference)
        got = load_file(run["eval"])
        eval_diff = abs(float(got["eval_loss"]) - float(ref_eval["eval_loss"]))
        assert got["logits"].shape == ref_eval["logits"].shape, (got["logits"].shape, ref_eval["logits"].shape)
        logits_diff = float((got["logits"] - ref_eval["logits"]).abs().max())
        print(
            f"tp {backend} {name}: max |param diff| {diff:.3e}; |eval_loss diff| {eval_diff:.3e}; "
            f"max |logits diff| {logits_diff:.3e}"
        )
        assert diff <= PARAM_ATOL and logits_diff <= OUTPUT_ATOL, (name, diff, logits_diff)
        assert eval_diff <= LOSS_ATOL + LOSS_RTOL * abs(float(ref_eval["eval_loss"])), (name, eval_diff)
    assert _max_diff(load_file(report["resumed"]["params"]), straight) == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fsdp", "spmd"])
def test_xla_trainer_matches_the_plain_trainer_and_resumes(tmp_path, plain_trainer, mode):
    """The same on 2 CPU PJRT devices: XLA FSDP (a Trainer per device thread, started by
    shardcore.launch) and SPMD (one controller, its batch the global one). XLA FSDP reduce-scatters each
    sharded parameter once per optimizer step with 2 accumulation steps (counted in the step's traced
    graph); SPMD's collectives are the partitioner's, inserted when it compiles. No thread adds or
    removes an environment variable while the Trainers run: each moved the C environment under
    another thread's getenv (XLA FSDP's process died in getenv, a CI failure with exit status -11)."""
    pytest.importorskip("torch_xla")
    report_path = tmp_path / "report.json"
    out = harness.python(harness.worker("trainer_xla"), mode, str(report_path), env=harness.xla_env(2), timeout=420)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    report = json.loads(report_path.read_text())
    assert report["environment_changes"] == [], report["environment_changes"][:20]
    _check_against_plain(report, plain_trainer, f"xla {mode}")
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        run, resumed = report[kind], report[kind + "-resumed"]
        assert run["world_size"] == (2 if mode == "fsdp" else 1), run  # SPMD: one controller
        if mode == "fsdp":
            assert run["reduce_scatters_per_step"] == [run["sharded_params"]] * 4, run
            assert resumed["reduce_scatters_per_step"] == [run["sharded_params"]] * 2, resumed


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fsdp", "spmd"])
def test_xla_trainer_trains_a_peft_model_and_saves_its_adapter(tmp_path, mode):
    """A PEFT LoRA model handed to the Trainer on 2 CPU PJRT devices: the adapter save_model writes is
    what PEFT loads, and its weights are the plain Trainer's on one process within param_atol."""
    pytest.importorskip("torch_xla")
    pytest.importorskip("peft")
    ref = tmp_path / "ref.safetensors"
    out = harness.python(harness.worker("trainer_fsdp2"), "reference", str(ref), "llama_lora", timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    reference = {k: v for k, v in load_file(ref).items() if "lora_" in k}
    report = tmp_path / "lora.json"
    out = harness.python(harness.worker("trainer_xla"), "lora", mode, str(report), env=harness.xla_env(2), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    got = json.loads(report.read_text())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(got["adapter_files"]), got
    assert "model.safetensors" not in got["adapter_files"], got
    adapter = load_file(got["adapter"])
    diff = _max_diff(adapter, reference)
    moved = max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k)  # B starts at zero
    print(f"xla {mode} LoRA: max |adapter - plain Trainer's| = {diff:.3e}; max |lora_B| = {moved:.3e}")
    assert diff <= PARAM_ATOL, diff
    assert moved > 1e-3, moved


@pytest.mark.multiprocess
def test_xla_fsdp_trainer_loads_the_best_model_at_end(tmp_path):
    """load_best_model_at_end on 2 XLA FSDP CPU devices, the best being the first checkpoint: the
    Trainer's own xm.rendezvous aborted the device threads here; the model ends with checkpoint-2's
    weights and the state file names it, as the plain Trainer's does."""
    pytest.importorskip("torch_xla")
    report = tmp_path / "best.json"
    out = harness.python(harness.worker("trainer_xla"), "best", str(report), env=harness.xla_env(2), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    got = json.loads(report.read_text())
    print(f"load_best_model_at_end: {got}")
    assert got["best_model_checkpoint"].endswith("checkpoint-2"), got
    assert got["saved_best_global_step"] == 2 and got["saved_best_model_checkpoint"].endswith("checkpoint-2"), got
    assert got["diff_to_best"] == 0.0, got


def test_xla_where_transformers_does_not_see_torch_xla_is_refused(tmp_path, tiny_llama, monkeypatch):
    """Transformers picks the Trainer's device from torch_xla being importable (USE_TORCH_XLA), not
    from fsdp_config: xla: true without it would feed the batches to another device."""
    import transformers.utils

    from shardcore.integrations.transformers import Trainer

    monkeypatch.setattr(transformers.utils, "is_torch_xla_available", lambda *a, **k: False)
    with pytest.raises(ShardConfigError, match="'xla'.*does not see torch_xla") as e:
        Trainer(model=tiny_llama, args=_args(tmp_path, fsdp=True, fsdp_config={"xla": True}), train_dataset=_data())
    assert e.value.key == "xla"


@pytest.mark.multiprocess
def test_xla_trainer_refusals(tmp_path):
    """In a process where Transformers sees torch_xla: the fsdp2 backend (the Trainer would run on
    the XLA device), SPMD turned on after TrainingArguments made its device (it crashed in the first
    step), weight decay on a model an XLA backend sharded (renamed) before the Trainer, and, when the
    Trainer is created, bf16 (the XLA backends take no mixed_precision) and the Trainer's own
    activation checkpointing (torch.utils.checkpoint fails on an XLA device), with TRL's SFTConfig
    defaults too."""
    pytest.importorskip("torch_xla")
    report = tmp_path / "refusals.json"
    out = harness.python(harness.worker("trainer_xla"), "refusals", str(report), env=harness.xla_env(1), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    got = json.loads(report.read_text())
    assert got["fsdp2"][0] == "xla" and "USE_TORCH_XLA=0" in got["fsdp2"][1], got
    assert got["spmd"][0] == "xla_fsdp_v2" and "shardcore.launch" in got["spmd"][1], got
    assert got["weight_decay"][0] == "weight_decay" and "rename" in got["weight_decay"][1], got
    assert got["bf16"][0] == "bf16" and "bf16=False" in got["bf16"][1], got
    assert got["activation_checkpointing"][0] == "activation_checkpointing", got
    assert "xla_fsdp_grad_ckpt" in got["activation_checkpointing"][1], got
    # TRL's SFTConfig turns both on by default: refused when the SFTTrainer is created, before its
    # dataset preparation, naming the first
    assert got["sft_defaults"][0] == "bf16", got


@pytest.mark.multiprocess
def test_trl_sft_trainer_with_the_mixin_trains_a_lora_adapter(tmp_path):
    """TRL's SFTTrainer + ShardcoreTrainerMixin, peft_config LoRA, 2 FSDP2 ranks: it trains and
    save_model writes the adapter directory PEFT loads."""
    pytest.importorskip("trl")
    report = tmp_path / "sft.json"
    out = harness.ranks(2, harness.worker("trainer_fsdp2"), "sft", str(report), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    got = json.loads(report.read_text())
    print(f"SFTTrainer: losses {got['losses']}, max |lora_B| {got['lora_b_max']:.3e}")
    assert len(got["losses"]) == 4 and all(0 < x < 10 for x in got["losses"]), got
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(got["adapter_files"]), got
    assert "model.safetensors" not in got["adapter_files"], got
    assert got["lora_b_max"] > 0, got


@pytest.fixture(scope="module")
def plain_sft(tmp_path_factory):
    """TRL's own SFTTrainer on one process, in fp32: its loss log."""
    pytest.importorskip("trl")
    report = tmp_path_factory.mktemp("plain_sft") / "sft.json"
    out = harness.python(harness.worker("trainer_fsdp2"), "sft-reference", str(report), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    return json.loads(report.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["fsdp", "spmd"])
def test_xla_trl_sft_trainer_with_the_mixin_trains_a_lora_adapter(tmp_path, plain_sft, mode):
    """TRL's SFTTrainer + the mixin on 2 CPU PJRT devices: on XLA FSDP's device threads (its
    constructor prepares the dataset main process first, and those waits go through the backend's
    barrier) and under SPMD (whose output sharding takes TRL's fused-loss output). It trains, the
    adapter loads with PEFT, and the first step's loss, taken before any update (LoRA's B starts at
    zero, so it is the base model's), is the plain SFTTrainer's within the suite's loss tolerance.
    Under SPMD (one controller, so PEFT draws LoRA's A as the plain run does) every step's is; on
    device threads, which share one RNG, device 0's A is drawn between the other thread's draws."""
    pytest.importorskip("torch_xla")
    report = tmp_path / "sft.json"
    out = harness.python(harness.worker("trainer_xla"), "sft", mode, str(report), env=harness.xla_env(2), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    got = json.loads(report.read_text())
    first = got["losses"][0]
    print(
        f"xla {mode} SFTTrainer: losses {got['losses']} (plain {plain_sft['losses']}), max |lora_B| {got['lora_b_max']:.3e}"
    )
    assert len(got["losses"]) == 4 and all(0 < x < 10 for x in got["losses"]), got
    compared = got["losses"] if mode == "spmd" else [first]
    for mine, theirs in zip(compared, plain_sft["losses"]):
        assert abs(mine - theirs) <= LOSS_ATOL + LOSS_RTOL * abs(theirs), (got["losses"], plain_sft["losses"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(got["adapter_files"]), got
    assert "model.safetensors" not in got["adapter_files"], got
    assert got["lora_b_max"] > 1e-3, got


EXAMPLE = harness.ROOT / "examples" / "trainer" / "train.py"


@pytest.mark.multiprocess
def test_the_trainer_example_runs_under_torchrun_and_accelerate_launch(tmp_path):
    """docs/trainer.md's script, examples/trainer/train.py, every way it shows (torchrun, accelerate
    launch, and with only the fsdp_config changed, XLA FSDP and SPMD on 2 CPU devices); its FULL
    export loads with from_pretrained."""
    from transformers import LlamaForCausalLM

    configs = harness.ROOT / "examples" / "configs"
    launches = {
        "torchrun": ([harness.BIN / "torchrun", "--standalone", "--nproc_per_node", "2", EXAMPLE], None),
        "accelerate": ([harness.BIN / "accelerate", "launch", "--multi_gpu", "--num_processes", "2", EXAMPLE], None),
    }
    if importlib.util.find_spec("torch_xla") is not None:
        for mode in ("xla_fsdp", "xla_spmd"):
            launches[mode] = ([sys.executable, EXAMPLE, configs / f"{mode}.json"], harness.xla_env(2))
    for name, (cmd, env) in launches.items():
        cwd = tmp_path / name
        cwd.mkdir()
        out = harness.run(cmd, cwd=cwd, env=env, timeout=300)
        # a text message: pytest cuts a tuple's repr to a few hundred characters, the cause included
        assert out.returncode == 0, f"{name}: exit {out.returncode}\n{harness.tail(out.stdout, out.stderr)}"
        assert out.stdout.count("final loss") == 1, f"{name}:\n{out.stdout[-2000:]}"
        export = cwd / "trainer-example"
        assert (export / "checkpoint-2" / "shardcore.json").is_file() and (export / "model.safetensors").is_file()
        LlamaForCausalLM.from_pretrained(export)
