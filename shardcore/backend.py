"""The required Backend protocol and the registry of backends.

A backend is any object implementing :class:`Backend` plus the optional capabilities it declares
(:mod:`shardcore.capabilities`), published by a distribution under the entry-point group
``shardcore.backends`` (``name = "package.module:BackendClass"``). The in-tree backends
(``shardcore-fsdp2``, ``shardcore-xla``) are found the same way; the core never imports them by
name. :func:`get_backend` checks the contract when it loads a backend. A name whose implementation
depends on the config (:class:`~shardcore.capabilities.ConfigResolved`) loads as a resolver, and
:func:`for_config` turns it into the implementation once the config is known.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

from torch import nn

from .capabilities import ConfigResolved, check_backend
from .config import ShardConfig
from .errors import BackendNotFoundError, BackendUnavailableError
from .plan import WrapPlan

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "shardcore.backends"


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    device: Any  # torch.device, or the backend's own device object


@runtime_checkable
class Backend(Protocol):
    """What every sharding backend implements; the optional rest is in :mod:`shardcore.capabilities`.
    See ``examples/vendor_backend`` for a minimal out-of-tree one.

    FULL checkpoints are one unsharded state dict with the original parameter names, so the four
    state-dict methods below are all a backend needs for :func:`shardcore.save` and
    :func:`shardcore.load` to move checkpoints between backends."""

    name: str
    #: the command that installs what this backend needs, quoted in "not available" errors
    install_hint: str
    #: ShardConfig fields this backend honours when they differ from their defaults
    supported_keys: frozenset[str]
    #: optional (read with ``getattr``): key -> why this backend refuses it, quoted in the
    #: UnsupportedKeyError when a config sets it
    # unsupported_reasons: Mapping[str, str]

    def is_available(self) -> tuple[bool, str]:
        """Whether this backend can run here, and why not. Must be cheap and must not raise."""
        ...

    def apply(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        """Shard ``model`` in place following ``plan``; return the module to train."""
        ...

    def world(self) -> World: ...

    def barrier(self) -> None: ...

    def local_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What this rank feeds its model from a global batch (the same on every rank): its slice
        along dim 0, on its device; or, for a single-controller backend (SPMD), the whole batch
        sharded across devices."""
        ...

    def all_reduce_sum(self, tensor: Any) -> Any:
        """Sum of ``tensor`` over ranks (identity where values are already global, as under SPMD).
        Collective."""
        ...

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Unsharded state dict with the original parameter names, on CPU; complete on rank 0
        (other ranks may return an empty dict). Collective: every rank must call it."""
        ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank. Collective."""
        ...

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        """Load an unsharded state dict (original names) into the sharded ``model``. Only rank 0's
        ``state_dict`` is read (the others pass ``{}``); each rank keeps its shard. A model whose
        tensors are on the meta device gets real ones. Collective."""
        ...

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s state unsharded and keyed by parameter name (the layout of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(full_state_dict=True)``),
        on CPU; complete on rank 0, other ranks may return ``{}``. Collective."""
        ...

    def load_full_optimizer_state_dict(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        """Inverse of :meth:`full_optimizer_state_dict`; only rank 0's ``state`` is read. Collective."""
        ...


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str
    target: str


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``torch.__version__`` (``"2.9.0+cu128"``): the
    release a backend's workarounds and certifications are keyed by."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    out: dict[str, metadata.EntryPoint] = {}
    for ep in eps:
        out.setdefault(ep.name, ep)
    return out


_instances: dict[str, Backend] = {}


def get_backend(name_or_backend: str | Backend) -> Backend:
    """Look a backend up by registered name, by ``module:Class`` path, or pass an instance through."""
    if not isinstance(name_or_backend, str):
        check_backend(name_or_backend, type(name_or_backend).__name__)
        return name_or_backend
    name = name_or_backend
    if name in _instances:
        return _instances[name]
    eps = _entry_points()
    if name in eps:
        target = eps[name].value
        obj = _load(target, name)
    elif ":" in name:
        obj = _load(name, name)
    else:
        raise BackendNotFoundError(
            f"shardcore config key 'backend': no backend named {name!r} is installed. Installed: "
            f"{', '.join(sorted(eps)) or 'none'}. Install its package (in-tree: pip install -e "
            f"backends/{name}) or pass 'module:Class'."
        )
    try:
        backend = obj() if isinstance(obj, type) else obj
    except Exception as e:  # noqa: BLE001 - whatever the class's constructor raises
        raise BackendUnavailableError(
            f"shardcore backend {name!r}: {target if name in eps else name!r} could not be constructed "
            f"({type(e).__name__}: {e})."
        ) from e
    check_backend(backend, name)
    _instances[name] = backend
    return backend


def _load(target: str, name: str) -> Any:
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
        return getattr(mod, attr) if attr else mod
    except Exception as e:  # noqa: BLE001 - ImportError, or whatever the module raises on import
        raise BackendUnavailableError(
            f"shardcore backend {name!r}: cannot load {target!r} ({type(e).__name__}: {e})."
        ) from e


def available_backends() -> list[BackendInfo]:
    """Every registered backend with whether it can run here and, if not, why."""
    out = []
    for name, ep in sorted(_entry_points().items()):
        try:
            ok, reason = get_backend(name).is_available()
        except BackendUnavailableError as e:
            ok, reason = False, str(e)
        out.append(BackendInfo(name, ok, reason, ep.value))
    return out


def for_config(backend: Backend, config: ShardConfig) -> Backend:
    """The implementation that serves ``config``: ``backend`` itself, or what a
    :class:`~shardcore.capabilities.ConfigResolved` backend resolves ``config`` to (checked like any
    loaded backend; it may raise ShardConfigError)."""
    if not isinstance(backend, ConfigResolved):
        return backend
    chosen = backend.resolve(config)
    if isinstance(chosen, ConfigResolved):
        raise BackendUnavailableError(
            f"shardcore backend {backend.name!r}: resolve() returned the resolver {type(chosen).__qualname__}; it "
            "must return an implementation (a backend that does not declare ConfigResolved)."
        )
    check_backend(chosen, f"{backend.name} (resolved)")
    return chosen


def resolve_backend(config: ShardConfig, override: str | Backend | None = None) -> Backend:
    """The backend ``config`` selects (for a :class:`~shardcore.capabilities.ConfigResolved` name, the
    implementation serving ``config``), checked to be available and to support every key set."""
    named = get_backend(override if override is not None else config.backend_name)
    ok, reason = named.is_available()
    if not ok:
        raise BackendUnavailableError(
            f"shardcore backend {named.name!r} is not available: {reason}. Install it with: {named.install_hint}"
        )
    backend = for_config(named, config)
    from .validate import check_supported_keys  # the checks live in one module; it imports this one

    check_supported_keys(config, backend)
    return backend
