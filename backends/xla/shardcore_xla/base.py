"""What the two XLA implementations share: the name and keys, the ranks' surface, FULL and sliced
checkpoints, tied aliases and launching on devices. Each mode's own methods are in fsdp_backend.py
(XLA FSDP) and spmd_backend.py (SPMD FSDPv2); backend.py picks one from the config.

Every method here is the same in both modes: where the modes differ inside it, the difference is the
:class:`Ranks` each implementation gives (collectives.py), not a branch here.
"""

from __future__ import annotations

import importlib
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
    ModelValidation,
    RenamesParameters,
    ShardedCheckpoints,
    SlicedLoading,
    StepEnd,
)
from shardcore.config import ShardConfig
from shardcore.plan import WrapPlan
from shardcore.ties import tied_names

from . import launching, slices
from . import state_dict as states
from .collectives import Ranks


class XlaBackendBase(
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
    """Not a backend by itself: an implementation adds ``_ranks``, ``_wrap`` and the capabilities'
    mode-specific methods (validation, batches, clipping, accumulation, SHARDED checkpoints, launch)."""

    name = "xla"
    #: the device type every rank runs on, whatever torch.accelerator reports
    device_type = "xla"
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
    _no_compile = (
        "XLA already compiles each step's whole graph (forward, backward and optimizer, cut at the "
        "step end) into one XLA program; torch.compile (dynamo with the openxla backend) in front of "
        "XLA FSDP or SPMD is a different way of tracing that shardcore neither offers nor tests."
    )
    unsupported_reasons = {
        "torch_compile": _no_compile,
        "torch_compile_backend": _no_compile,
        "torch_compile_mode": _no_compile,
        "use_cpu": "XLA runs on the PJRT device of the environment, not on a device shardcore picks: set "
        "PJRT_DEVICE=CPU to run XLA on the CPU.",
    }

    @property
    def _ranks(self) -> Ranks:
        """How this process's ranks meet now (collectives.py)."""
        raise NotImplementedError

    def _wrap(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        raise NotImplementedError

    def is_available(self) -> tuple[bool, str]:
        from .backend import available  # one check, beside the registered name

        return available()

    def apply(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        # tied names, decided on the unwrapped model (the wrappers rename and deduplicate)
        aliases = tied_names(model)
        out = self._wrap(model, plan, config)
        object.__setattr__(out, "_shardcore_tied_aliases", aliases)
        return out

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

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank (one under SPMD). Collective."""
        return self._ranks.all_gather_object(obj)

    def step_end(self) -> None:
        """Cut and run the step's lazy graph (``torch_xla.sync()``); call it after ``optimizer.step()``.

        On several CPU devices the device threads take turns, so that all run one compiled module."""
        self._ranks.sync()

    def compile_count(self) -> int:
        """XLA compilations so far in this process (torch_xla's ``UncachedCompile`` counter)."""
        return int(importlib.import_module("torch_xla.debug.metrics").counter_value("UncachedCompile") or 0)

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

    def original_names(self, model: nn.Module) -> dict[str, list[str]]:
        layout = states.param_layout(model)
        return {n: [orig for orig, _ in layout[id(p)]] for n, p in model.named_parameters()}

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

    # -- launching (used by shardcore-conformance and available to scripts) ----------------------
    def run_on_devices(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(ordinal)`` once per device (CPU: threads of this process; else ``xmp.spawn``); see launching.py."""
        launching.run_on_devices(fn)
