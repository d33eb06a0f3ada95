"""XLA backend: what ``TrainingArguments(fsdp_config={"xla": True, ...})`` does, driven by a WrapPlan.

* ``xla_fsdp_v2: false`` (default): ``XlaFullyShardedDataParallel`` on every plan unit, then on the
  root, with ``xla_fsdp_settings`` as its keyword arguments (``compute_dtype``/``buffer_dtype`` names
  become torch dtypes, as the Trainer converts them). One device per process or thread
  (``xmp.spawn`` / ``torch_xla.launch``). See fsdp.py.
* ``xla_fsdp_v2: true``: SPMD ``SpmdFullyShardedDataParallel`` over a mesh of every device, axes
  ``("fsdp", "model")`` (HSDP, ``dp_replicate_size`` > 1: ``("replicate", "fsdp")``); one process drives
  all devices; inputs and Hugging Face outputs are sharded along the batch (Trainer's ``shard_output``). See spmd.py.
* ``xla_fsdp_grad_ckpt: true``: torch_xla's ``checkpoint_module`` on each unit before wrapping.

The wrapping decision is the plan's: torch_xla's own auto-wrap machinery is handed a policy that says
yes exactly to the plan's unit modules.

This class only delegates: settings.py (config to torch_xla arguments, and its checks), collectives.py
(how ranks meet), state_dict.py / slices.py / sharded.py (FULL, sliced FULL, SHARDED checkpoints),
launching.py, cpu.py (several CPU devices), unit_fix.py (fixes for torch_xla bugs). Config errors come
from :meth:`validate` or :meth:`validate_model`, before :meth:`apply`, which raises none.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Any, Callable

import torch
from torch import nn

from shardcore.backend import World
from shardcore.capabilities import (
    CompileCounter,
    ConfigValidation,
    DeviceLaunch,
    GradClipping,
    GradSyncControl,
    Launcher,
    LaunchSpec,
    ModelValidation,
    RenamesParameters,
    ShardedCheckpoints,
    SlicedLoading,
    StepEnd,
)
from shardcore.config import ShardConfig
from shardcore.distributed import check_batch_divides
from shardcore.plan import WrapPlan
from shardcore.ties import tied_names
from shardcore.validate import check_rank0_weights

from . import cpu, fsdp, launching, settings, sharded, slices, spmd
from . import state_dict as states
from .collectives import Ranks


class XLABackend(
    ShardedCheckpoints,
    StepEnd,
    GradClipping,
    GradSyncControl,
    Launcher,
    DeviceLaunch,
    ConfigValidation,
    ModelValidation,
    CompileCounter,
    RenamesParameters,
    SlicedLoading,
):
    name = "xla"
    install_hint = "pip install torch==2.9.0 torch_xla==2.9.0 && pip install -e backends/xla"
    supported_keys = frozenset(
        {
            "auto_wrap_policy",
            "transformer_layer_cls_to_wrap",
            "min_num_params",
            "reshard_after_forward",
            "state_dict_type",
            "cpu_ram_efficient_loading",
            "xla",
            "xla_fsdp_v2",
            "xla_fsdp_settings",
            "xla_fsdp_grad_ckpt",
            "dp_replicate_size",
            "dp_shard_size",
        }
    )

    #: shardcore's fixes for XLA FSDP units that return several tensors (unit_fix.py)
    unit_fixes = True

    def __init__(self) -> None:
        # the process's mode (SPMD is global to a process), once a model was validated or sharded
        self._spmd: bool | None = None
        self._mesh = None
        # XLA FSDP on several CPU devices: the device threads of this process (see cpu.py)
        self._threads: cpu.DeviceThreads | None = None

    @property
    def _ranks(self) -> Ranks:
        """How this process's ranks meet now (collectives.py)."""
        return Ranks(bool(self._spmd), self._threads)

    # -- validation (shard() runs it before apply) ---------------------------------------------------
    def validate(self, config: ShardConfig) -> None:
        """Raise ShardConfigError for settings or keys this backend refuses, from the config alone."""
        settings.check_config(config, self._spmd)

    def validate_model(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> None:
        """What :meth:`apply` would otherwise meet halfway: SPMD cannot fill a meta-device model; each
        mode checks the HSDP sizes against its devices; XLA FSDP on several CPU devices refuses what
        the CPU recipe cannot honour, and needs every device's model to match device 0's (with
        ``cpu_ram_efficient_loading``, rank 0's weights). Collective under XLA FSDP, one verdict."""
        if config.xla_fsdp_v2:
            spmd.check_model(model, config)
            return
        self._use_fsdp(config)  # the collectives below need the device threads
        settings.check_fsdp_replicas(config, self.world().size)
        if self._threads is not None:
            settings.check_cpu_fsdp_settings(config)
        if self._from_rank0(config):
            check_rank0_weights(model, self.world().rank, self.broadcast_object, self._ranks.all_gather_object)
        elif self._threads is not None:
            fsdp.check_same_model(model, self._threads)

    # -- sharding -----------------------------------------------------------------------------------
    def is_available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("torch_xla") is None:
            return False, "torch_xla is not installed"
        return True, f"torch_xla (PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'auto')})"

    def apply(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        # tied names, decided on the unwrapped model (the wrappers rename and deduplicate)
        aliases = tied_names(model)
        out = self._apply_spmd(model, plan, config) if config.xla_fsdp_v2 else self._apply_fsdp(model, plan, config)
        object.__setattr__(out, "_shardcore_tied_aliases", aliases)
        return out

    def _apply_fsdp(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        self._use_fsdp(config)
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

    def _apply_spmd(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        self._spmd = True
        self._mesh = spmd.mesh(self._mesh, spmd.shape(config)[0])
        return spmd.wrap(model, plan, self._mesh, config.xla_fsdp_grad_ckpt, settings.spmd_kwargs(config))

    def _use_fsdp(self, config: ShardConfig) -> None:
        """XLA FSDP's mode and, on several CPU devices, the device threads (checked and idempotent)."""
        self._spmd = False
        self._threads = fsdp.device_threads(config)

    def _from_rank0(self, config: ShardConfig) -> bool:
        return config.cpu_ram_efficient_loading and self.world().size > 1

    def tied_aliases(self, model: nn.Module) -> dict[str, str]:
        """``{tied name not stored in a FULL checkpoint: the name that is}``, in unwrapped names."""
        return dict(getattr(model, "_shardcore_tied_aliases", {}))

    # -- ranks ----------------------------------------------------------------------------------------
    def world(self) -> World:
        """Under SPMD one controller drives every device: a single rank whose values are global."""
        return World(self._ranks.rank(), self._ranks.size(), importlib.import_module("torch_xla").device())

    def barrier(self) -> None:
        self._ranks.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks. Under SPMD a value is already global, so this is the identity."""
        return self._ranks.all_reduce_sum(tensor)

    def broadcast_object(self, obj: Any) -> Any:
        return self._ranks.broadcast_object(obj)

    # -- training loop ----------------------------------------------------------------------------
    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank feeds its model from a global batch: its slice (XLA FSDP), or the whole
        batch sharded along dim 0 over the mesh's data axes (SPMD)."""
        import torch_xla.runtime as xr

        w = self.world()
        check_batch_divides(batch, xr.global_runtime_device_count() if self._spmd else w.size, "devices")
        return spmd.shard_batch(batch, self._mesh) if self._spmd else fsdp.local_slice(batch, w.rank, w.size)

    def step_end(self) -> None:
        """Cut and run the step's lazy graph (``torch_xla.sync()``); call it after ``optimizer.step()``.

        On several CPU devices the device threads take turns, so that all run one compiled module."""
        self._ranks.sync()

    def compile_count(self) -> int:
        """XLA compilations so far in this process (torch_xla's ``UncachedCompile`` counter)."""
        return int(importlib.import_module("torch_xla.debug.metrics").counter_value("UncachedCompile") or 0)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """SPMD parameters are global, so torch's own function is right. Under XLA FSDP each rank
        holds flat shards of every gradient; see :func:`fsdp.clip_grad_norm_`."""
        if self._spmd:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return fsdp.clip_grad_norm_(model, max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> Any:
        """XLA FSDP: accumulate full gradients without reduce-scatter (XlaFullyShardedDataParallel's
        ``no_sync``). SPMD: nothing to do, the compiler places the reductions."""
        if self._spmd:
            return contextlib.nullcontext()
        return model.no_sync()

    # -- checkpoints: the FULL format of every backend (one unsharded state dict, original names)
    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """One unsharded state dict with the original parameter names, on CPU (every rank gets it).

        The same format the FSDP2 backend writes, so a checkpoint moves between backends."""
        full = states.full_state_dict(model, self._ranks)
        # a tied weight appears under each of its names, as in the unwrapped model's state_dict()
        return states.with_aliases(full, self.tied_aliases(model), lambda t: t.clone())

    def full_state_dict_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """The keys and shapes :meth:`full_state_dict` returns, without gathering anything."""
        return states.with_aliases(states.full_state_dict_shapes(model), self.tied_aliases(model), lambda s: s)

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        """Put an unsharded state dict (read on rank 0 only) into the sharded model, each rank taking
        its shard the way the wrapper laid it out."""
        states.load_full_state_dict(model, state_dict, self._ranks)
        self.step_end()

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s state unsharded and keyed by parameter name (the layout of
        ``get_optimizer_state_dict(full_state_dict=True)``), on CPU."""
        return states.full_optimizer_state_dict(model, optimizer, self._ranks)

    def load_full_optimizer_state_dict(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        states.load_full_optimizer_state_dict(model, optimizer, state, self._ranks)
        self.step_end()

    # -- sliced FULL reads (slices.py); no models without weights: XLA FSDP wraps real tensors
    def shards_without_weights(self, config: ShardConfig) -> bool:
        return False

    def load_full_slices(self, model: nn.Module, fill: Any) -> None:
        slices.load_full_slices(model, fill, self._ranks)

    def read_optimizer_slices(self, model: nn.Module, osd: dict[str, Any], fill: Any) -> dict[str, Any]:
        return slices.read_optimizer_slices(model, osd, fill, self._ranks)

    def load_optimizer_slices(self, model: nn.Module, optimizer: Any, part: dict[str, Any]) -> None:
        slices.load_optimizer_slices(model, optimizer, part, self._ranks)

    def save_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        """SPMD: torch.distributed.checkpoint with torch_xla's SPMD planners. XLA FSDP: each rank
        writes its shards, rank 0 the shard index (see sharded.py). Collective."""
        self.step_end()  # the values to write exist only once the pending graph has run
        if self._spmd:
            sharded.save_spmd(model, optimizer, path, states.strip_wrappers)
            return
        w = self.world()
        layout, buffers = states.param_layout(model), states.persistent_buffers(model)
        sharded.save_fsdp(model, optimizer, path, w.rank, w.size, layout, buffers)
        self.barrier()  # rank 0 commits the directory after this returns: every shard must be there

    def load_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        """Read a checkpoint of :meth:`save_sharded_state_dict` from a run of any device count. Collective."""
        sharded.check_mode(path, bool(self._spmd))
        if self._spmd:
            sharded.load_spmd(model, optimizer, path, states.strip_wrappers)
            self.step_end()
            return
        full, osd = sharded.read_fsdp(path) if self.world().rank == 0 else ({}, None)
        self.load_full_state_dict(model, full)
        if optimizer is not None:
            self.load_full_optimizer_state_dict(model, optimizer, osd or {})

    # -- launching (used by shardcore-conformance and available to scripts) ----------------------
    def launch_spec(self, config: ShardConfig, world_size: int) -> LaunchSpec:
        return launching.launch_spec(config, world_size)

    def run_on_devices(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(ordinal)`` once per device (``xmp.spawn``); see launching.py."""
        launching.run_on_devices(fn)

    def launch(self, fn: Callable[[], None], config: ShardConfig) -> None:
        """``fn()`` once per local device under XLA FSDP (``xmp.spawn``), once under SPMD."""
        if config.xla_fsdp_v2:
            fn()
        else:
            self.run_on_devices(functools.partial(launching.without_ordinal, fn))
