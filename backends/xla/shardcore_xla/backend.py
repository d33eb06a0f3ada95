"""XLA backend: what ``TrainingArguments(fsdp_config={"xla": True, ...})`` does, driven by a WrapPlan.

The registered name ``xla`` is one name for two implementations, picked by ``xla_fsdp_v2`` when the
config is known (:class:`shardcore.capabilities.ConfigResolved`):

* ``xla_fsdp_v2: false`` (default): XLA FSDP, :class:`~shardcore_xla.fsdp_backend.XlaFsdpBackend`;
* ``xla_fsdp_v2: true``: SPMD FSDPv2, :class:`~shardcore_xla.spmd_backend.SpmdBackend`.

What they share is in base.py. Either way the wrapping decision is the plan's: torch_xla's own
auto-wrap machinery is handed a policy that says yes exactly to the plan's unit modules. The modules
they delegate to: settings.py (config to torch_xla arguments, and its checks), collectives.py (how
ranks meet), state_dict.py / slices.py / sharded.py (FULL, sliced FULL, SHARDED checkpoints),
launching.py, cpu.py (several CPU devices), unit_fix.py (fixes for torch_xla bugs). Config errors come
from ``validate`` or ``validate_model``, before ``apply``, which raises none.

SPMD is global to a process (``xr.use_spmd()``): once a process validated or sharded a model in one
mode, a config of the other is refused (settings.py keeps that process state).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

from shardcore.capabilities import ConfigResolved, ConfigValidation, DeviceLaunch, Launcher, LaunchSpec
from shardcore.config import ShardConfig

from . import launching
from .base import XlaBackendBase
from .fsdp_backend import XlaFsdpBackend
from .spmd_backend import SpmdBackend


def available() -> tuple[bool, str]:
    if importlib.util.find_spec("torch_xla") is None:
        return False, "torch_xla is not installed"
    return True, f"torch_xla (PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'auto')})"


class XLABackend(ConfigResolved, ConfigValidation, Launcher, DeviceLaunch):
    """The ``xla`` name: resolves a config to its implementation, one instance of each per resolver."""

    name = XlaBackendBase.name
    install_hint = XlaBackendBase.install_hint
    supported_keys = SpmdBackend.supported_keys  # XLA FSDP refuses the tensor-parallel keys itself
    unsupported_reasons = XlaBackendBase.unsupported_reasons
    device_type = XlaBackendBase.device_type

    def __init__(self) -> None:
        self._by_v2 = {False: XlaFsdpBackend(), True: SpmdBackend()}

    def is_available(self) -> tuple[bool, str]:
        return available()

    def resolve(self, config: ShardConfig) -> XlaBackendBase:
        return self._by_v2[config.xla_fsdp_v2]

    # what the name answers before a model exists, from the implementation the config picks
    def validate(self, config: ShardConfig) -> None:
        self.resolve(config).validate(config)

    def launch(self, fn: Callable[[], None], config: ShardConfig) -> None:
        self.resolve(config).launch(fn, config)

    def launch_spec(self, config: ShardConfig, world_size: int) -> LaunchSpec:
        return self.resolve(config).launch_spec(config, world_size)

    def run_on_devices(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(ordinal)`` once per device (threads of this process on CPU, ``xmp.spawn`` elsewhere), as XLA FSDP's launch spec asks."""
        launching.run_on_devices(fn)
