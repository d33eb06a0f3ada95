"""The Hugging Face ``Trainer`` on shardcore: one import changes, the script stays.

    from shardcore.integrations.transformers import Trainer   # instead of: from transformers import Trainer

With ``TrainingArguments(fsdp=True, fsdp_config=...)`` the ``fsdp_config`` is the shard config (every
key :func:`shardcore.parse_config` reads; the FSDP2 backend: ``xla: true`` is refused until the XLA
backends are wired into the Trainer's data loading), and the model goes through :func:`shardcore.shard`
instead of accelerate's wrapping. A model the script sharded itself
(``shardcore.shard`` before the Trainer) is trained as it is, with the config it was sharded with.
Without either, the class is ``transformers.Trainer`` unchanged.

What changes inside, and only on this Trainer instance (no patch of transformers or accelerate
outlives it): the optimizer is built on the sharded parameters; clipping is
:func:`shardcore.clip_grad_norm_`; accumulation micro-batches run under :func:`shardcore.no_sync`; the
logged loss is the mean over ranks (``reduce``); each step ends with ``step_end()``; ``save_model``
writes a FULL checkpoint (``from_pretrained`` loads it, an adapter directory for a PEFT model);
``save_strategy`` checkpoints and ``resume_from_checkpoint`` go through :func:`shardcore.save` /
:func:`shardcore.load` in the config's ``state_dict_type``, beside the Trainer's own scheduler, RNG and
``trainer_state.json`` files. :class:`ShardcoreTrainerMixin` gives any ``Trainer`` subclass (TRL's
``SFTTrainer``...) the same behaviour: ``class MySFT(ShardcoreTrainerMixin, SFTTrainer)``.

Transformers is imported when this module is; the core never imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer_callback import TrainerCallback

from .. import api, loop
from ..checkpoint import load as _sc_load
from ..checkpoint import save as _sc_save
from ..config import ShardConfig, parse_config
from ..errors import ShardConfigError

log = logging.getLogger(__name__)

#: the Trainer's own file names (transformers.trainer SCHEDULER_NAME, TRAINING_ARGS_NAME)
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"

#: TrainingArguments that configure DistributedDataParallel, which this Trainer never uses: set, they
#: would be silently ignored
_DDP_ONLY_ARGS = ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph")


def _shard_config_for(model: Any, args: Any) -> ShardConfig | None:
    """The config shardcore shards with, or None where the Trainer is plain ``transformers.Trainer``
    (no ``fsdp`` and a model shardcore did not shard)."""
    h = api.handle_or_none(model) if isinstance(model, nn.Module) else None
    if h is not None:
        if getattr(args, "fsdp", None):
            raise ShardConfigError(
                "fsdp",
                f"is {args.fsdp!r} in TrainingArguments, but the model passed to the Trainer is already sharded "
                f"by shardcore.shard() (backend {h.backend.name!r}). Either pass the unsharded model and let the "
                "Trainer shard it with fsdp_config, or drop fsdp/fsdp_config from TrainingArguments.",
            )
        return h.config
    if not getattr(args, "fsdp", None):
        return None
    return parse_config(args)


def _refuse_what_cannot_apply(trainer: Any) -> None:
    """TrainingArguments and Trainer inputs that cannot mean here what they mean to the plain Trainer."""
    args = trainer.args
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        raise ShardConfigError(
            "deepspeed",
            f"is {getattr(args, 'deepspeed', None)!r} in TrainingArguments, but this Trainer shards with shardcore "
            "(fsdp_config); DeepSpeed would shard the same model a second way. Remove deepspeed, or use "
            "transformers.Trainer for a DeepSpeed run.",
        )
    for name in _DDP_ONLY_ARGS:
        value = getattr(args, name, None)
        if value is not None:
            raise ShardConfigError(
                name,
                f"is {value!r} in TrainingArguments; it configures DistributedDataParallel, which a model sharded "
                "by shardcore never goes through. Remove it.",
            )
    if getattr(args, "auto_find_batch_size", False):
        raise ShardConfigError(
            "auto_find_batch_size",
            "is True in TrainingArguments; finding the batch size retries training on a freshly wrapped model, "
            "and a model sharded by shardcore is sharded once. Set per_device_train_batch_size yourself.",
        )
    if getattr(args, "n_gpu", 1) > 1:
        raise ShardConfigError(
            "n_gpu",
            f"is {args.n_gpu}: this process sees several GPUs and the Trainer would wrap the model in "
            "torch.nn.DataParallel. Launch one process per device (torchrun, accelerate launch).",
        )


class _StepEnd(TrainerCallback):
    """``step_end()`` after each optimizer step (the Trainer's ``on_step_end`` comes after
    ``optimizer.step()``, the scheduler and ``zero_grad``): XLA cuts and runs the step's graph there."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        h = api.handle_or_none(self.trainer.model)
        if h is not None:
            h.step_end()


class ShardcoreTrainerMixin:
    """Trains through shardcore when ``TrainingArguments.fsdp`` is set (its ``fsdp_config`` is the
    shard config) or the model was sharded by :func:`shardcore.shard`; a plain Trainer otherwise.
    Put it first among the bases: ``class MyTrainer(ShardcoreTrainerMixin, SomeTrainer)``."""

    #: the config the model is (or will be) sharded with; None: this is a plain Trainer
    _shardcore_config: ShardConfig | None = None

    # -- setup -----------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        # The Trainer calls this from __init__ with self.model and self.args set, before anything
        # reads the FSDP and XLA flags: the one point where the mode can be decided.
        self._shardcore_config = _shard_config_for(self.model, self.args)
        if self._shardcore_config is None:
            return super().create_accelerator_and_postprocess()
        if self._shardcore_config.backend_name == "xla":
            # Not wired yet: XLA FSDP on CPU runs devices as threads of one process, where accelerate's
            # process-wide state (PartialState) would give every device thread the first one's rank and
            # device, so the Trainer's data sharding and gathers would be wrong. Refused, not run wrong.
            raise ShardConfigError(
                "xla",
                "is true in fsdp_config, but shardcore's Trainer integration runs on the fsdp2 backend only for "
                "now (the XLA backends are not wired into the Trainer's data loading yet). Use the shardcore "
                "training loop on XLA (docs/training.md, examples/demo.py), or the fsdp2 backend with this Trainer.",
            )
        _refuse_what_cannot_apply(self)
        super().create_accelerator_and_postprocess()
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            # accelerate read its own FSDP/DeepSpeed settings from the environment (accelerate launch
            # with distributed_type FSDP/DEEPSPEED): it would wrap the model a second time
            raise ShardConfigError(
                "distributed_type",
                "accelerate's launch config turns on its own FSDP or DeepSpeed (ACCELERATE_USE_FSDP / "
                "ACCELERATE_USE_DEEPSPEED in the environment), but this Trainer shards with shardcore. Launch with "
                "a plain multi-process accelerate config (distributed_type MULTI_GPU, MULTI_CPU or XLA) and keep "
                "the sharding settings in TrainingArguments.fsdp_config.",
            )
        # accelerate's no_sync looks for model.no_sync, which a sharded model does not have (FSDP2):
        # every micro-batch would reduce. This instance's accelerator only.
        self.accelerator.no_sync = _shardcore_no_sync

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        out = super()._build_accelerator_args(**kwargs)
        if self._shardcore_config is not None:
            out["fsdp_plugin"] = None  # shardcore shards; accelerate must not
            # precision is the shard config's (mixed_precision, from bf16/fp16 too): autocast and a
            # grad scaler on top would apply it twice
            out["mixed_precision"] = "no"
        return out

    # The Trainer's XLA FSDP paths (its own wrap_model_xla_fsdp, SPMD mesh and input sharding,
    # per-rank optimizer files) are shardcore's backend's job here: their flags read False.
    @property
    def is_fsdp_xla_v2_enabled(self) -> bool:
        return self._shardcore_config is None and self.__dict__.get("_plain_xla_v2", False)

    @is_fsdp_xla_v2_enabled.setter
    def is_fsdp_xla_v2_enabled(self, value: bool) -> None:
        self.__dict__["_plain_xla_v2"] = value

    @property
    def is_fsdp_xla_v1_enabled(self) -> bool:
        return self._shardcore_config is None and self.__dict__.get("_plain_xla_v1", False)

    @is_fsdp_xla_v1_enabled.setter
    def is_fsdp_xla_v1_enabled(self, value: bool) -> None:
        self.__dict__["_plain_xla_v1"] = value

    def _validate_args(self) -> None:
        if self._shardcore_config is not None and api.handle_or_none(self.model) is None:
            if self.optimizer is not None or self.lr_scheduler is not None:
                raise ShardConfigError(
                    "optimizers",
                    "were passed to the Trainer, built on the model's parameters before sharding; shard() replaces "
                    "them, so that optimizer would update nothing. Pass optimizer_cls_and_kwargs instead, or shard "
                    "the model with shardcore.shard() first and build the optimizer on its parameters.",
                )
        if self._shardcore_config is not None and self.optimizer is not None:
            # the Trainer's own check refuses any optimizer under FSDP; one built on the sharded
            # parameters is right here
            saved, self.optimizer = self.optimizer, None
            saved_sched, self.lr_scheduler = self.lr_scheduler, None
            try:
                super()._validate_args()
            finally:
                self.optimizer, self.lr_scheduler = saved, saved_sched
            return
        super()._validate_args()

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        if self._shardcore_config is None:
            return super()._move_model_to_device(model, device)
        # shard() places the shards on each rank's device

    def _shardcore_model(self) -> nn.Module:
        """The sharded model, sharding it on first use (training, or an evaluation before it)."""
        if api.handle_or_none(self.model) is None:
            self.model = api.shard(self.model, self._shardcore_config)
        self.model_wrapped = self.model
        return self.model

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self._shardcore_config is None:
            return super()._wrap_model(model, training, dataloader)
        return self._shardcore_model()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._shardcore_config is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        model = self._shardcore_model()
        # on the sharded parameters; not accelerate-prepared: its optimizer wrapper would all-reduce
        # gradients on XLA that the backend has already reduce-scattered
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        if not any(isinstance(cb, _StepEnd) for cb in self.callback_handler.callbacks):
            self.callback_handler.callbacks.insert(0, _StepEnd(self))
        if resume_from_checkpoint is not None:
            _sc_load(model, resume_from_checkpoint, None if self.args.save_only_model else self.optimizer)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _update_auto_batch_size(self, batch_size):
        if self._shardcore_config is None:
            return super()._update_auto_batch_size(batch_size)
        self._train_batch_size = batch_size

    # -- the step --------------------------------------------------------------------------------
    def _clip_grad_norm(self, model):
        if self._shardcore_config is None:
            return super()._clip_grad_norm(model)
        return loop.clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._shardcore_config is None:
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:  # max_grad_norm 0: the norm is still logged, nothing is clipped
            grad_norm = loop.clip_grad_norm_(self.model, math.inf)
        return grad_norm

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, **kw):
        if self._shardcore_config is not None and (
            self.control.should_log and self.state.global_step > self._globalstep_last_logged
        ):
            # the loss logged is the mean over ranks (sc.reduce: a collective every backend has; the
            # Trainer's nested_gather is torch.distributed's or torch_xla's rendezvous); then the
            # Trainer's own method sees nothing left to log and goes on to evaluate and save
            h = api.handle(self.model)
            tr_loss_scalar = float(h.reduce(tr_loss.detach()))
            tr_loss -= tr_loss
            logs: dict[str, float] = {"loss": tr_loss_scalar / (self.state.global_step - self._globalstep_last_logged)}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm) if isinstance(grad_norm, torch.Tensor) else grad_norm
            lr = kw.get("learning_rate")
            logs["learning_rate"] = lr if lr is not None else self._get_learning_rate()
            self._total_loss_scalar += tr_loss_scalar
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()
            self.log(logs, start_time)
        return super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, **kw
        )

    # -- saving ----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._shardcore_config is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self._shardcore_model()
        if getattr(self, "_shardcore_checkpoint", False):
            # a save_strategy checkpoint: the config's format, with the optimizer, for resuming
            optimizer = None if self.args.save_only_model else self.optimizer
            _sc_save(model, output_dir, optimizer)
        else:
            _save_full_into(model, Path(output_dir))
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        api.handle(model).barrier()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial) -> None:
        if self._shardcore_config is None:
            return super()._save_checkpoint(model, trial)
        self._shardcore_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._shardcore_checkpoint = False

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._shardcore_config is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # the optimizer is in the shardcore checkpoint (save_model above); the scheduler is the same
        # small object on every rank
        if self.args.should_save:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # -- loading ---------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self._shardcore_config is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # train() calls this before the model is sharded; the weights and the optimizer are loaded
        # together once they are (_prepare_for_training)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._shardcore_config is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            with warnings.catch_warnings(record=True):
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self) -> None:
        if self._shardcore_config is None:
            return super()._load_best_model()
        _sc_load(self._shardcore_model(), self.state.best_model_checkpoint)


def _shardcore_no_sync(model: nn.Module | None = None) -> contextlib.AbstractContextManager:
    return loop.no_sync(model) if model is not None else contextlib.nullcontext()


def _save_full_into(model: nn.Module, out: Path) -> None:
    """A FULL checkpoint in ``out``. ``save_model()`` writes into the output directory, which holds
    the run's ``checkpoint-N`` directories too and so is no shardcore checkpoint that a save could
    replace as a whole: there the files are written beside a temporary directory inside it and moved
    up, as ``save_pretrained`` would write them."""
    h = api.handle(model)
    if not out.exists() or (out / "shardcore.json").is_file() or (out.is_dir() and not any(out.iterdir())):
        _sc_save(model, out, state_dict_type="FULL_STATE_DICT")
        return
    name = f".shardcore-export-{uuid.uuid4().hex[:12]}" if h.is_main_process else ""
    name = _broadcast_name(h, name)
    tmp = out / name
    _sc_save(model, tmp, state_dict_type="FULL_STATE_DICT")
    if h.is_main_process:
        for f in tmp.iterdir():
            if f.name == "shardcore.json":  # the directory is not a shardcore checkpoint
                continue
            dest = out / f.name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(f, dest)
        shutil.rmtree(tmp, ignore_errors=True)
    h.barrier()


def _broadcast_name(h: api.ShardedModel, name: str) -> str:
    """Rank 0's temporary name on every rank (the checkpoint code's own rank-0 helper)."""
    from ..checkpoint.runtime import on_rank0

    return on_rank0(h.backend, lambda: name)


class Trainer(ShardcoreTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that shards through shardcore: a drop-in, same constructor.

    ``TrainingArguments(fsdp=True, fsdp_config={...})``: the ``fsdp_config`` is the shard config.
    Without ``fsdp`` (and with a model shardcore did not shard) it is ``transformers.Trainer``."""


__all__ = ["ShardcoreTrainerMixin", "Trainer"]
