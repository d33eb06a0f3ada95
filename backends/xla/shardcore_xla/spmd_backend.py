"""SPMD FSDPv2 (``xla_fsdp_v2: true``): ``SpmdFullyShardedDataParallel`` over a mesh of every device,
axes ``("fsdp", "model")`` (HSDP, ``dp_replicate_size`` > 1: ``("replicate", "fsdp")``). One process
drives all devices as one rank whose values are global; inputs and Hugging Face outputs are sharded
along the batch (the Trainer's ``shard_output``). See spmd.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from shardcore.capabilities import LaunchSpec, TensorParallel
from shardcore.config import ShardConfig
from shardcore.distributed import check_batch_divides
from shardcore.plan import WrapPlan

from . import launching, settings, sharded, spmd
from . import state_dict as states
from .base import XlaBackendBase
from .collectives import Ranks


class SpmdBackend(XlaBackendBase, TensorParallel):
    #: the SPMD partitioner inserts the collectives when it compiles: not in the graph the suite reads
    communication_pattern = "spmd"
    #: a ``tensor`` mesh axis to split weights over (spmd.py)
    supported_keys = XlaBackendBase.supported_keys | {"tp_size", "tp_plan"}

    def __init__(self) -> None:
        self._mesh = None  # the global mesh, once a model was sharded
        self._tp = 1  # the tensor axis of that mesh

    @property
    def _ranks(self) -> Ranks:
        return Ranks(True, None)

    # -- validation (shard() runs it before apply) ---------------------------------------------------
    def validate(self, config: ShardConfig) -> None:
        """Raise ShardConfigError for settings this mode refuses, from the config alone."""
        settings.check_mode(config, serves=True)
        settings.check_spmd_settings(config)

    def validate_model(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> None:
        """SPMD cannot fill a meta-device model, and the HSDP sizes must factor the devices. One
        controller, so one verdict without collectives."""
        spmd.check_model(model, config)

    # -- sharding -----------------------------------------------------------------------------------
    def _wrap(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        settings.claim_mode(True)
        self._mesh = spmd.mesh(self._mesh, spmd.shape(config)[0], config.tp_size)
        self._tp = config.tp_size
        return spmd.wrap(model, plan, self._mesh, config.xla_fsdp_grad_ckpt, settings.spmd_kwargs(config))

    # -- training loop ----------------------------------------------------------------------------
    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole global batch, sharded along dim 0 over the mesh's data axes (every device of
        one ``tensor`` row gets the same rows)."""
        n = spmd.device_count() // self._tp
        check_batch_divides(
            batch, n, "devices" if self._tp == 1 else f"data-parallel device groups (tp_size {self._tp})"
        )
        return spmd.shard_batch(batch, self._mesh)

    def root_mesh(self, config: ShardConfig) -> Any:
        """The global SPMD mesh (``torch_xla.distributed.spmd.Mesh``, axes ``fsdp`` and ``tensor``,
        ``replicate`` first under HSDP); None with ``tp_size`` 1. One process holds every device and
        the whole batch, so no data loader deals rows by it."""
        if config.tp_size == 1:
            return None
        return spmd.mesh(self._mesh, spmd.shape(config)[0], config.tp_size)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """SPMD parameters are global, so torch's own function is right."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> Any:
        """Nothing to do: the compiler places the reductions."""
        return contextlib.nullcontext()

    # -- SHARDED checkpoints: torch.distributed.checkpoint with torch_xla's SPMD planners (sharded.py)
    def save_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        self.step_end()  # the values to write exist only once the pending graph has run
        sharded.save_spmd(model, optimizer, path, states.strip_wrappers)

    def load_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        """Read a checkpoint of :meth:`save_sharded_state_dict` from a run of any device count."""
        sharded.check_mode(path, spmd=True)
        sharded.load_spmd(model, optimizer, path, states.strip_wrappers)
        self.step_end()

    # -- launching ------------------------------------------------------------------------------------
    def launch_spec(self, config: ShardConfig, world_size: int) -> LaunchSpec:
        return launching.spmd_launch_spec(world_size)

    def launch(self, fn: Callable[[], None], config: ShardConfig) -> None:
        """``fn()`` once: this process drives every device, in SPMD mode from the start."""
        spmd.enable()
        with launching.steady_environment():
            fn()
