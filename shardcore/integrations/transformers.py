"""The Hugging Face ``Trainer`` on shardcore: one import changes, the script stays.

    from shardcore.integrations.transformers import Trainer   # instead of: from transformers import Trainer

With ``TrainingArguments(fsdp=True, fsdp_config=...)`` the ``fsdp_config`` is the shard config (every
key :func:`shardcore.parse_config` reads, on every backend: FSDP2 under torchrun or ``accelerate launch``,
XLA FSDP and SPMD under :func:`shardcore.launch`), and the model goes through :func:`shardcore.shard`
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

On XLA the Trainer keeps its own XLA path where it still applies (accelerate's XLA state and device
loader) and the backend replaces the rest; what is swapped for XLA FSDP's CPU device threads, and
why, is in docs/trainer.md ("Backends"). While its Accelerator is created, accelerate's
``clear_environment`` clears ``os.environ`` for the creating thread alone (_environ.py says why).

Transformers is imported when this module is; the core never imports this module.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import shutil
import threading
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import api, loop
from ..capabilities import RenamesParameters
from ..checkpoint import load as _sc_load
from ..checkpoint import manager as _manager
from ..checkpoint import save as _sc_save
from ..checkpoint.manifest import is_checkpoint
from ..config import ShardConfig, parse_config
from ..errors import CheckpointError, ShardConfigError
from ._environ import thread_scoped_clear_environment

log = logging.getLogger(__name__)
_RNG_LOAD_LOCK = threading.Lock()

#: the Trainer's own file names (transformers.trainer SCHEDULER_NAME, TRAINING_ARGS_NAME)
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
TRAINER_STATE_NAME = "trainer_state.json"

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


def _checked_config(model: Any, args: Any) -> ShardConfig | None:
    """:func:`_shard_config_for`, with the checks of the config against this process's XLA state."""
    config = _shard_config_for(model, args)
    if config is not None:
        _check_xla_matches_transformers(config)
        _check_spmd_started_first(config)
    return config


def _check_the_backend_takes(config: ShardConfig, args: Any) -> Any:
    """The backend ``config`` selects, checked to take every key set when the Trainer is created
    rather than when it first trains. A ``mixed_precision`` the backend refuses that came from the
    Trainer's ``bf16``/``fp16`` flag is refused naming the flag, the key the script wrote."""
    from ..backend import resolve_backend
    from ..errors import UnsupportedKeyError

    try:
        return resolve_backend(config)
    except UnsupportedKeyError as e:
        fsdp_config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
        flag = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
        if e.key != "mixed_precision" or flag is None or {"mixed_precision", "fsdp_mixed_precision"} & set(fsdp_config):
            raise
        raise ShardConfigError(
            flag,
            f"is True in TrainingArguments, which shardcore reads as mixed_precision={flag!r}, and the "
            f"{config.backend_name!r} backend does not support mixed_precision. Set {flag}=False (TRL's "
            "SFTConfig sets bf16=True by default) to train in the model's own dtype.",
        ) from None


@contextlib.contextmanager
def _accelerate_waits_through(backend: Any, args: Any):
    """On XLA, accelerate's ``wait_for_everyone`` in this thread (``PartialState``'s, which
    ``main_process_first`` and ``Accelerator.wait_for_everyone`` call) is the backend's barrier while
    the Trainer is created. accelerate waits with ``xm.rendezvous``, which on CPU device threads syncs
    without the backend's serialization and gathers with a pinned layout: each thread compiled a
    module of its own and the process aborted at an XLA rendezvous (TRL's SFTTrainer, whose
    constructor prepares its dataset main process first). accelerate keeps its state per thread on
    XLA, so only this thread's waits change, and only until the Trainer exists."""
    if backend.name != "xla":
        yield
        return
    from accelerate.state import PartialState

    args.device  # noqa: B018  (sets up this thread's accelerate state from the arguments, as the Trainer would next)
    state = PartialState()
    state.wait_for_everyone = backend.barrier
    try:
        yield
    finally:
        state.__dict__.pop("wait_for_everyone", None)


def _refuse_trainer_checkpointing_on_xla(config: ShardConfig, args: Any) -> None:
    """The Trainer's own activation checkpointing is ``torch.utils.checkpoint``, which on an XLA device
    fails in the first forward (``module 'torch' has no attribute 'xla'``: it looks for a device
    module that torch_xla does not register). The XLA backends checkpoint with torch_xla's own."""
    if config.backend_name != "xla":
        return
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        raise ShardConfigError(
            "activation_checkpointing",
            "(gradient_checkpointing) is True in TrainingArguments, which turns on torch.utils.checkpoint; on an "
            "XLA device it fails in the first forward (module 'torch' has no attribute 'xla'). Set it to False "
            "(TRL's SFTConfig sets gradient_checkpointing=True by default) and put xla_fsdp_grad_ckpt: true in "
            "fsdp_config: the backend then checkpoints every unit with torch_xla's checkpoint_module.",
        )


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
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "")))
    if trainer._shardcore_on_xla and optim == "adamw_torch_fused":
        # torch's fused AdamW has kernels for cpu, cuda and a few more, not for XLA tensors: the
        # first step would fail inside torch.optim. It is TrainingArguments' default from torch 2.8 on.
        raise ShardConfigError(
            "optim",
            "is 'adamw_torch_fused' in TrainingArguments (its default from torch 2.8 on), but torch's fused AdamW "
            "has no kernels for XLA tensors, where the xla backend keeps the parameters. Set optim='adamw_torch' "
            "(or 'adamw_torch_xla').",
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


def _check_xla_matches_transformers(config: ShardConfig) -> None:
    """Transformers and accelerate pick the Trainer's device from whether torch_xla is importable
    (``USE_TORCH_XLA``), not from the shard config: the two must agree, or the batches go to one device
    and the shards live on another."""
    from transformers.utils import is_torch_xla_available

    xla = config.backend_name == "xla"
    if xla and not is_torch_xla_available():
        raise ShardConfigError(
            "xla",
            f"is true in fsdp_config, but Transformers does not see torch_xla (USE_TORCH_XLA="
            f"{os.environ.get('USE_TORCH_XLA', '<unset>')!r}, or torch_xla is not installed), so the Trainer would "
            "feed its batches to another device. Install the XLA backend (pip install shardcore-xla) and unset "
            "USE_TORCH_XLA, or drop xla from fsdp_config.",
        )
    if not xla and is_torch_xla_available():
        raise ShardConfigError(
            "xla",
            f"is not set in fsdp_config, so the {config.backend_name!r} backend shards, but torch_xla is installed and "
            "Transformers and accelerate then run the Trainer on the XLA device. Launch with USE_TORCH_XLA=0 in the "
            "environment, or set xla: true in fsdp_config to train with the XLA backend.",
        )


def _check_spmd_started_first(config: ShardConfig) -> None:
    """SPMD mode is global to a process and must be on before the first XLA tensor, and
    ``TrainingArguments`` makes the XLA device when it is created: by the time the Trainer exists it
    is too late to turn on (torch_xla would replicate what exists, and the first step crashed with a
    segfault here). ``shardcore.launch`` turns it on before the script's function runs."""
    if config.backend_name != "xla" or not config.xla_fsdp_v2:
        return
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        raise ShardConfigError(
            "xla_fsdp_v2",
            "is true in fsdp_config, but this process's XLA runtime is not in SPMD mode, and TrainingArguments "
            "already made its XLA device: SPMD must be on before that. Run the script's training function with "
            "shardcore.launch(main, fsdp_config), which turns it on first, or call torch_xla.runtime.use_spmd() "
            "before creating TrainingArguments.",
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

    @property
    def _shardcore_on_xla(self) -> bool:
        """Sharded by one of shardcore's XLA backends (XLA FSDP or SPMD)."""
        return self._shardcore_config is not None and self._shardcore_config.backend_name == "xla"

    # -- setup -----------------------------------------------------------------------------------
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # What the config cannot do is refused before a subclass's own set-up runs (TRL's SFTTrainer
        # prepares its dataset, across ranks, before Trainer.__init__), not in the first step.
        model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
        targs = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
        config = _checked_config(model, targs) if targs is not None else None
        if config is None:
            return super().__init__(*args, **kwargs)
        backend = _check_the_backend_takes(config, targs)
        _refuse_trainer_checkpointing_on_xla(config, targs)
        with _accelerate_waits_through(backend, targs):
            super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        # The Trainer calls this from __init__ with self.model and self.args set, before anything
        # reads the FSDP and XLA flags: the one point where the mode can be decided.
        # (again: a subclass's set-up may have replaced the model since __init__ looked)
        self._shardcore_config = _checked_config(self.model, self.args)
        if self._shardcore_config is None:
            return super().create_accelerator_and_postprocess()
        _refuse_what_cannot_apply(self)
        with thread_scoped_clear_environment():
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
        if self._shardcore_tp_processes() > 1:
            self._shardcore_tensor_parallel()
        if self._shardcore_on_xla:
            # accelerate gathers with torch_xla's all_gather, a collective inside the lazy graph that
            # the next unserialized sync runs: on CPU device threads each thread would compile its own
            # module and their rendezvous never meet. shardcore's collectives meet every backend's ranks.
            self.accelerator.gather = self._shardcore_gather
            self.accelerator.pad_across_processes = self._shardcore_pad_across_processes

    def _shardcore_tensor_parallel(self) -> None:
        """The data loaders deal one batch to every rank of a tp group: accelerate does so for a
        device mesh with a ``tp`` dim, so it gets the backend's. Evaluation gathers each tp group's
        outputs once, from its first rank. (The Trainer's own gathers, of token counts, stay
        whole: it divides them by :meth:`get_tp_size` itself.)"""
        import functools
        import inspect

        from ..backend import resolve_backend

        mesh = resolve_backend(self._shardcore_config).root_mesh(self._shardcore_config)
        accelerator, tp = self.accelerator, mesh["tp"].size()
        accelerator.state.device_mesh = mesh
        whole_gather, for_metrics = accelerator.gather, accelerator.gather_for_metrics

        def once_per_tp_group(data: Any) -> Any:
            from accelerate.utils import recursively_apply

            def first_of_each_group(t: torch.Tensor) -> torch.Tensor:
                # every rank's rows in rank order; the ranks of one tp group are neighbours
                rows = t.reshape(-1, tp, t.shape[0] // accelerator.num_processes, *t.shape[1:])
                return rows[:, 0].flatten(0, 1)

            return recursively_apply(first_of_each_group, whole_gather(data), error_on_other_type=True)

        def gather_for_metrics(input_data: Any, use_gather_object: bool = False) -> Any:
            # before accelerate drops the last batch's padding, which it counts in data-parallel rows
            accelerator.gather = once_per_tp_group
            try:
                return for_metrics(input_data, use_gather_object=use_gather_object)
            finally:
                accelerator.gather = whole_gather

        accelerator.gather_for_metrics = gather_for_metrics
        # the Trainer took the method when it made the accelerator (and takes it again after each evaluation)
        self.gather_function = accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )

    def get_tp_size(self) -> int:
        # the Trainer asks the model (transformers' own TP) or accelerate's parallelism config, which
        # shardcore keeps from accelerate: its token counts and batch sizes must know the tp groups
        if self._shardcore_config is not None:
            return self._shardcore_tp_processes()
        return super().get_tp_size()

    def _shardcore_tp_processes(self) -> int:
        """Processes in one tensor-parallel group: ``tp_size``, except under SPMD, where one process
        drives every device and reads the whole batch (the Trainer's sizes count processes)."""
        config = self._shardcore_config
        return 1 if self._shardcore_on_xla and config.xla_fsdp_v2 else config.tp_size

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        out = super()._build_accelerator_args(**kwargs)
        if self._shardcore_config is not None:
            out["fsdp_plugin"] = None  # shardcore shards; accelerate must not
            # the shard config holds the parallelism config's sizes, and the backend builds the mesh:
            # accelerate would build a second one (and refuses one outright on the CPU, MULTI_CPU)
            out.pop("parallelism_config", None)
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
            # decided on the unsharded model: its names and module types (a norm's weight is not
            # decayed), which a renaming wrapper (XLA FSDP) does not keep
            self._shardcore_decay = set(super().get_decay_parameter_names(self.model))
            self.model = api.shard(self.model, self._shardcore_config)
        self.model_wrapped = self.model
        return self.model

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        h = api.handle_or_none(model) if self._shardcore_config is not None else None
        if h is None or not isinstance(h.backend, RenamesParameters):
            return super().get_decay_parameter_names(model)
        decay = self.__dict__.get("_shardcore_decay")
        if decay is None:
            if not self.args.weight_decay:
                return []
            raise ShardConfigError(
                "weight_decay",
                f"is {self.args.weight_decay} in TrainingArguments, and the model was sharded before the Trainer by "
                f"the {h.backend.name!r} backend, whose wrappers rename its parameters: the Trainer could no longer "
                "tell which are norms and biases (not decayed). Pass the unsharded model with fsdp_config, or set "
                "weight_decay=0.",
            )
        out = []
        for name, originals in h.backend.original_names(model).items():
            decayed = [o in decay for o in originals]
            if all(decayed):
                out.append(name)
            elif any(decayed):
                raise ShardConfigError(
                    "weight_decay",
                    f"is {self.args.weight_decay} in TrainingArguments, but the sharded parameter {name!r} holds "
                    f"{originals}, some decayed and some not (flattened into one): one optimizer group cannot "
                    "treat them apart. Turn flattening off in the backend's settings or set weight_decay=0.",
                )
        return out

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, *args: Any, **kwargs: Any):
        if self._shardcore_config is None:
            return super().train(resume_from_checkpoint, trial, *args, **kwargs)
        resume_from_checkpoint = _resolve_resume(Path(self.args.output_dir), resume_from_checkpoint)
        try:
            out = super().train(resume_from_checkpoint, trial, *args, **kwargs)
        except BaseException:
            pending, self._shardcore_pending = getattr(self, "_shardcore_pending", None), None
            if pending is not None:
                pending.join()  # its error is the lesser one; no collective while ranks fail
            raise
        self._shardcore_settle()
        return out

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
    def _prepare_inputs(self, inputs):
        inputs = super()._prepare_inputs(inputs)
        if self._shardcore_on_xla and self._shardcore_config.xla_fsdp_v2 and isinstance(inputs, dict):
            # one controller: its batch is the global one, sharded along the batch over the mesh
            # (the plain Trainer's FSDPv2 input_sharding)
            h = api.handle(self._shardcore_model())
            batched = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
            inputs = {**inputs, **h.local_batch(batched)}
        return inputs

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        out = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self._shardcore_on_xla:
            # the evaluation loop's own xm.mark_step() is not serialized across CPU device threads,
            # and this graph holds the forward's all-gathers: run it here, the backend's way
            api.handle(self.model).step_end()
        return out

    def _shardcore_gather(self, data: Any) -> Any:
        """accelerate's ``gather`` (every rank's tensors concatenated along dim 0, scalars as one
        row each) through the backend's all-reduce: each rank fills its own rows of a zero buffer."""
        from accelerate.utils import recursively_apply

        h = api.handle(self._shardcore_model())

        def one(t: torch.Tensor) -> torch.Tensor:
            row = t.detach().reshape(1) if t.dim() == 0 else t.detach()
            if h.world_size == 1:
                return row
            # filled on the host: a device-side fill would differ by rank, and so would each lazy
            # device's graph
            buf = torch.zeros((h.world_size, *row.shape), dtype=row.dtype)
            buf[h.rank] = row.cpu()
            return h.backend.all_reduce_sum(buf).to(row.device).flatten(0, 1)

        return recursively_apply(one, data, error_on_other_type=True)

    def _shardcore_pad_across_processes(self, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        """accelerate's ``pad_across_processes`` with the sizes gathered by :meth:`_shardcore_gather`."""
        from accelerate.utils import recursively_apply

        def one(t: torch.Tensor) -> torch.Tensor:
            if dim >= t.dim() or dim < -t.dim():
                return t
            d = dim % t.dim()
            sizes = self._shardcore_gather(torch.tensor([t.shape[d]]))
            longest = int(sizes.max())
            if longest == t.shape[d]:
                return t
            shape = list(t.shape)
            shape[d] = longest - t.shape[d]
            pad = t.new_full(shape, pad_index)
            return torch.cat([pad, t] if pad_first else [t, pad], dim=d)

        return recursively_apply(one, data, error_on_other_type=True)

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
            if self._shardcore_config.async_save:
                self._shardcore_stage(model, Path(output_dir), optimizer)
            else:
                _sc_save(model, output_dir, optimizer)
        else:
            self._shardcore_settle()
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
        self._shardcore_settle()
        run_dir = Path(self._get_output_dir(trial=trial))
        output_dir = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            _clear_unfinished(output_dir, also_complete=bool(self._shardcore_config.async_save))
        self._shardcore_checkpoint = True
        best = self.state.best_global_step
        hide_best = best and self._shardcore_on_xla
        if hide_best:
            # With a best checkpoint the Trainer waits for every rank with xm.rendezvous, whose
            # unserialized sync and in-graph all_gather abort XLA FSDP's CPU device threads at a
            # rendezvous (XLA's 10 s termination, seen here); save_model has already waited, with the
            # backend's barrier. What the Trainer does after the wait is done here, before the state
            # file is written: the best checkpoint is this one, or one an earlier save left.
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
            if best == self.state.global_step or os.path.exists(best_dir):
                self.state.best_model_checkpoint = best_dir
            self.state.best_global_step = None
        # The Trainer rotates by modification time before anything marks the checkpoint complete, and
        # counts directories it did not write: here save_total_limit applies once this one is marked.
        args, self.args = self.args, copy.copy(self.args)
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args = args
            self._shardcore_checkpoint = False
            if hide_best:
                self.state.best_global_step = best
        if hide_best and self.args.should_save:
            # written by the Trainer while best_global_step was hidden
            self.state.save_to_json(str(output_dir / TRAINER_STATE_NAME))
        h = api.handle(self._shardcore_model())
        h.barrier()  # every rank's RNG state is written
        step, best_dir = self.state.global_step, self.state.best_model_checkpoint
        limit = self.args.save_total_limit if self.args.save_total_limit and self.args.save_total_limit > 0 else None
        meta = {"format": _manager.TRAINER_FORMAT, "step": step, "world_size": h.world_size, "backend": h.backend.name}

        def complete() -> None:  # the checkpoint's main process; no collective, so it may run in a thread
            _manager.write_marker(output_dir, meta)
            found, _ = _manager.scan(run_dir, PREFIX_CHECKPOINT_DIR, _trainer_checkpoint_problem)
            protected = {output_dir} | ({Path(best_dir)} if best_dir else set())
            _manager.rotate(run_dir, PREFIX_CHECKPOINT_DIR, found, limit, protected)

        staged = getattr(self, "_shardcore_staged", None)
        self._shardcore_staged = None
        if staged is None:
            if self.args.should_save:
                complete()
            return

        # async_save: the model is bound for a hidden sibling; the Trainer's files written here move
        # into it, and once the model is written it takes this directory's place, then is marked
        def finish() -> None:
            for f in list(output_dir.iterdir()):
                os.replace(f, staged.tmp / f.name)
            staged.write()
            complete()

        work = finish if self.args.should_save else staged.wait
        self._shardcore_pending = _manager.Background(step, output_dir, staged.tmp, h.backend, work)

    def _shardcore_stage(self, model: nn.Module, final: Path, optimizer: Any) -> None:
        """The collective half of an async checkpoint: the state in CPU memory, bound for a hidden
        sibling of ``final``, which the Trainer's own files go into meanwhile."""
        from ..checkpoint import stage

        self._shardcore_staged = stage(model, final, optimizer, background=True)
        if self.args.should_save:
            final.mkdir(parents=True, exist_ok=True)

    def _shardcore_settle(self) -> None:
        """Finish the async checkpoint in flight; an error on any rank is raised on every rank,
        naming the step. Collective."""
        pending, self._shardcore_pending = getattr(self, "_shardcore_pending", None), None
        if pending is None:
            return
        error = pending.join()
        try:
            _manager.agree(pending.runtime, error, f"the background save of {pending.final}")
        except CheckpointError as e:
            raise CheckpointError(
                f"the Trainer's checkpoint of step {pending.step} ({str(pending.final)!r}) was not completed: {e}. "
                "It has no marker, so resume_from_checkpoint=True skips it."
            ) from e

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

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # transformers reads it inside torch.serialization.safe_globals(), which sets and then
        # restores one process-wide allowlist: XLA FSDP's CPU device threads, each resuming, would
        # restore each other's list away mid-read ("Unsupported global: numpy...", seen here)
        with _RNG_LOAD_LOCK:
            super()._load_rng_state(checkpoint)

    def _load_best_model(self) -> None:
        if self._shardcore_config is None:
            return super()._load_best_model()
        _sc_load(self._shardcore_model(), self.state.best_model_checkpoint)


def _clear_unfinished(path: Path, also_complete: bool) -> None:
    """Set aside a ``checkpoint-<N>`` whose save died before its marker (the Trainer writes into the
    directory of its step in any case): the save of step N starts from an empty one. An async save
    gathers the Trainer's files in it, so a complete one of the same step goes too."""
    if not path.is_dir() or path.is_symlink() or (not also_complete and (path / _manager.STEP_MARKER).is_file()):
        return
    ours = ("shardcore.json", TRAINER_STATE_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME)
    if any((path / name).exists() for name in ours) or any(path.glob("rng_state*.pth")):
        log.warning("shardcore: %s holds a checkpoint whose save did not finish; replacing it", path)
        _manager.discard(path)


def _trainer_checkpoint_problem(path: Path, step: int, meta: dict[str, Any]) -> str | None:
    """Why a marked ``checkpoint-<N>`` cannot be resumed, or None."""
    if not is_checkpoint(path):
        return "it holds no complete shardcore checkpoint of the model"
    if not (path / TRAINER_STATE_NAME).is_file():
        return f"it has no {TRAINER_STATE_NAME}"
    return None


def _resolve_resume(output_dir: Path, resume: str | bool | None) -> str | None:
    """``resume_from_checkpoint`` as a path: for True, the newest ``checkpoint-<N>`` whose save
    finished (the Trainer's own choice is the highest number, complete or not)."""
    if resume is None or resume is False:
        return None
    if resume is not True:
        path = Path(resume)
        if path.is_dir() and not (path / _manager.STEP_MARKER).is_file():
            log.warning(
                "shardcore: %s has no %s, so its save may not have finished; resuming from it as asked",
                path,
                _manager.STEP_MARKER,
            )
        return str(resume)
    found, skipped = _manager.scan(output_dir, PREFIX_CHECKPOINT_DIR, _trainer_checkpoint_problem)
    for path, why in skipped:
        log.warning("shardcore: not resuming from %s: %s", path, why)
    if not found:
        raise CheckpointError(
            f"resume_from_checkpoint=True: {str(output_dir)!r} holds no complete {PREFIX_CHECKPOINT_DIR}-<N> "
            f"({len(skipped)} incomplete or not written by shardcore's Trainer). Pass resume_from_checkpoint=None to "
            "start afresh, or the path of a checkpoint."
        )
    step, path, _ = max(found)
    log.info("shardcore: resuming from %s, the newest complete checkpoint", path)
    return str(path)


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
