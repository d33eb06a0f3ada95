"""XLA FSDP (``xla_fsdp_v2: false``): ``XlaFullyShardedDataParallel`` on every plan unit, then on the
root, with ``xla_fsdp_settings`` as its keyword arguments (``compute_dtype``/``buffer_dtype`` names
become torch dtypes, as the Trainer converts them); ``xla_fsdp_grad_ckpt``: torch_xla's
``checkpoint_module`` on each unit before wrapping. One device per process (``xmp.spawn`` /
``torch_xla.launch``) or, on several CPU devices, per thread of one process (cpu.py). See fsdp.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from shardcore.capabilities import LaunchSpec
from shardcore.checkpoint.runtime import on_rank0
from shardcore.config import ShardConfig
from shardcore.distributed import check_batch_divides
from shardcore.plan import WrapPlan
from shardcore.validate import check_rank0_weights

from . import cpu, fsdp, launching, settings, sharded
from . import state_dict as states
from .base import XlaBackendBase
from .collectives import Ranks


class XlaFsdpBackend(XlaBackendBase):
    #: the conformance suite reads each rank's collectives from its traced graph and checks them
    communication_pattern = "xla_fsdp"
    #: shardcore's fixes for XLA FSDP units that return several tensors (unit_fix.py)
    unit_fixes = True
    _no_tp = (
        "XLA FSDP (xla_fsdp_v2: false) flattens each parameter and shards the flat vector: it has no tensor dim "
        "to split a weight along. Set xla_fsdp_v2: true for tensor parallelism on XLA (SPMD, mesh (fsdp, tensor)), "
        "or use the fsdp2 backend."
    )
    unsupported_reasons = {**XlaBackendBase.unsupported_reasons, "tp_size": _no_tp, "tp_plan": _no_tp}

    def __init__(self) -> None:
        # on several CPU devices: the device threads of this process (cpu.py), once a model was validated
        self._threads: cpu.DeviceThreads | None = None
        # the config shardcore.launch started the devices with (its timeout bounds an early barrier)
        self._launched: ShardConfig | None = None

    @property
    def _ranks(self) -> Ranks:
        return Ranks(False, self._threads)

    def barrier(self) -> None:
        """Every rank, also before the first ``shard()`` (a Trainer subclass that prepares its data
        main process first): on several CPU devices the device threads then meet in Python already,
        where torch_xla's ``xm.rendezvous`` would compile a module per thread and abort the process at
        an XLA rendezvous."""
        if self._threads is None:
            self._threads = fsdp.device_threads(self._launched or ShardConfig())
        super().barrier()

    # -- validation (shard() runs it before apply) ---------------------------------------------------
    def validate(self, config: ShardConfig) -> None:
        """Raise ShardConfigError for settings this mode refuses, from the config alone."""
        settings.check_mode(config, serves=False)
        settings.check_fsdp_settings(config)

    def validate_model(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> None:
        """The HSDP sizes against the devices; on several CPU devices what the CPU recipe cannot
        honour, and every device's model matching device 0's (with ``cpu_ram_efficient_loading``,
        rank 0's weights). Collective, one verdict."""
        fsdp.check_float32_parameters(model)  # from the model alone: a refused model claims no process mode
        self._start(config)  # the collectives below need the device threads
        settings.check_fsdp_replicas(config, self.world().size)
        if self._threads is not None:
            settings.check_cpu_fsdp_settings(config)
        if self._from_rank0(config):
            check_rank0_weights(model, self.world().rank, self.broadcast_object, self.all_gather_object)
        elif self._threads is not None:
            fsdp.check_same_model(model, self._threads)

    # -- sharding -----------------------------------------------------------------------------------
    def _wrap(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        self._start(config)
        kwargs = settings.fsdp_kwargs(config)
        if self._threads is not None:
            kwargs = settings.cpu_fsdp_kwargs(kwargs)
        # cpu_ram_efficient_loading: the other ranks may hold meta tensors; rank 0's weights fill the
        # shards after wrapping
        rank0 = states.rank0_weights(model, self.world().rank) if self._from_rank0(config) else None
        if rank0 is None and self._threads is not None:
            fsdp.start_from_device0(model, self._threads)
        out = fsdp.wrap(model, plan, kwargs, config.xla_fsdp_grad_ckpt, self.unit_fixes)
        if rank0 is not None:
            self.load_full_state_dict(out, rank0)  # non-persistent buffers (rotary inv_freq) included
        return out

    def _start(self, config: ShardConfig) -> None:
        """This process's mode and, on several CPU devices, the device threads (checked and idempotent)."""
        settings.claim_mode(False)
        self._threads = fsdp.device_threads(config)

    def _from_rank0(self, config: ShardConfig) -> bool:
        return config.cpu_ram_efficient_loading and self.world().size > 1

    # -- training loop ----------------------------------------------------------------------------
    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a global batch, on its device."""
        w = self.world()
        check_batch_divides(batch, w.size, "devices")
        return fsdp.local_slice(batch, w.rank, w.size)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Each rank holds flat shards of every gradient; see :func:`fsdp.clip_grad_norm_`."""
        return fsdp.clip_grad_norm_(model, max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> Any:
        """Accumulate full gradients without reduce-scatter (XlaFullyShardedDataParallel's ``no_sync``)."""
        return model.no_sync()

    # -- SHARDED checkpoints: each rank writes its shards, rank 0 the shard index (sharded.py)
    def save_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        self.step_end()  # the values to write exist only once the pending graph has run
        w = self.world()
        layout, buffers = states.param_layout(model), states.persistent_buffers(model)
        sharded.save_fsdp(model, optimizer, path, w.rank, w.size, layout, buffers)
        self.barrier()  # rank 0 commits the directory after this returns: every shard must be there

    def load_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        """Read a checkpoint of :meth:`save_sharded_state_dict` from a run of any device count. Collective."""
        sharded.check_mode(path, spmd=False)
        # a damaged checkpoint fails on rank 0; every rank must learn it before the broadcast below
        full, osd = on_rank0(self, lambda: sharded.read_fsdp(path), share=False) or ({}, None)
        self.load_full_state_dict(model, full)
        if optimizer is not None:
            self.load_full_optimizer_state_dict(model, optimizer, osd or {})

    # -- launching ------------------------------------------------------------------------------------
    def launch_spec(self, config: ShardConfig, world_size: int) -> LaunchSpec:
        return launching.fsdp_launch_spec(world_size)

    def launch(self, fn: Callable[[], None], config: ShardConfig) -> None:
        """``fn()`` once per local device (launching.run_on_devices)."""
        self._launched = config
        self.run_on_devices(functools.partial(launching.without_ordinal, fn))
