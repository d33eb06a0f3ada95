"""Optional backend capabilities, and the check every backend passes when it is loaded.

A backend implements the required :class:`shardcore.Backend` protocol and *declares* each optional
capability it has by naming the capability among its base classes::

    class MyBackend(TorchDistributedRuntime, ShardedCheckpoints, GradClipping):
        ...

:func:`check_backend` runs when :func:`shardcore.get_backend` loads a backend (pluggy-style: at
load, not at first use). It refuses, naming the members:

* a required member that is missing;
* a declared capability whose methods the backend does not define (a method inherited from the
  capability's own class is a stub, so it counts as missing);
* a capability whose methods the backend defines without declaring it: ``isinstance`` checks on
  these runtime-checkable protocols are structural, so an undeclared one would still be used;
* ``state_dict_type`` among its ``supported_keys`` without :class:`ShardedCheckpoints`, and
  ``tp_size`` or ``tp_plan`` without :class:`TensorParallel`;
* a :class:`ConfigResolved` backend declaring more than :data:`BEFORE_RESOLVE`.

After the check, ``isinstance(backend, Capability)`` is true exactly for the declared capabilities,
and every caller (the loop helpers, checkpoints, the conformance suite) asks that instead of probing
attributes. Without a capability, a caller either does what is right for a backend that does not
need it (no step end, no local accumulation) or raises naming the capability.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from torch import nn

from .config import ShardConfig
from .errors import BackendUnavailableError


@runtime_checkable
class ShardedCheckpoints(Protocol):
    """``state_dict_type: SHARDED_STATE_DICT`` in :func:`shardcore.save` / :func:`shardcore.load`:
    every rank writes and reads its own shards."""

    def save_sharded_state_dict(self, model: nn.Module, optimizer: Any | None, path: str) -> None:
        """Write ``model`` (and ``optimizer``) as a ``torch.distributed.checkpoint`` directory at
        ``path`` (it exists and is empty), state keyed ``model.<name>`` and ``optimizer.<...>``; every
        rank writes its own shards. Collective."""
        ...

    def load_sharded_state_dict(self, model: nn.Module, optimizer: Any | None, path: str) -> None:
        """Read a directory written by :meth:`save_sharded_state_dict`, possibly by a run of another
        world size, into ``model`` (and ``optimizer``). Read it with :mod:`shardcore.safe_dcp`, which
        runs no code from the checkpoint. Collective."""
        ...


@runtime_checkable
class AsyncShardedCheckpoints(Protocol):
    """``CheckpointManager(async_save=True)`` with SHARDED_STATE_DICT: the loop waits only while
    the state is copied to CPU memory."""

    def async_save_sharded_state_dict(self, model: nn.Module, optimizer: Any | None, path: str) -> Callable[[], None]:
        """Copy what :meth:`ShardedCheckpoints.save_sharded_state_dict` writes into CPU memory (a
        collective), then write it to ``path`` in the background. Returns a function that waits for
        the write on this rank and raises its error. The background write uses a process group of
        its own, so the training loop's collectives go on beside it."""
        ...


@runtime_checkable
class AsyncFullCheckpoints(Protocol):
    """``CheckpointManager(async_save=True)`` with FULL_STATE_DICT: the loop waits only while each
    rank copies its own shards to CPU memory; the gather to rank 0 runs in the background."""

    def snapshot_full_state_dict(self, model: nn.Module, optimizer: Any | None) -> Callable[[], tuple[dict, Any]]:
        """Copy this rank's shards of the model's and the optimizer's state into CPU memory.
        Returns a function that gathers them into what :meth:`Backend.full_state_dict` and
        ``full_optimizer_state_dict`` return (rank 0: ``(state, osd or None)``; the others:
        ``({}, None)``). Every rank calls it, from a thread: its collectives use a process group of
        its own, never the training loop's."""
        ...


@runtime_checkable
class StepEnd(Protocol):
    """Lazy-tensor backends (XLA): cut and run the step's graph after ``optimizer.step()``
    (``shardcore.handle(model).step_end()``, a no-op without the capability)."""

    def step_end(self) -> None: ...


@runtime_checkable
class GradClipping(Protocol):
    """:func:`shardcore.clip_grad_norm_`: clip by the norm of the whole gradient, as ``torch.nn.utils.clip_grad_norm_``
    would on the unsharded model; return that norm (a scalar tensor, the same on every rank)."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> Any: ...


@runtime_checkable
class GradSyncControl(Protocol):
    """:func:`shardcore.no_sync`: a context manager within which backward accumulates gradients locally
    without reducing them across ranks; the first backward after it reduces everything accumulated."""

    def no_sync(self, model: nn.Module) -> Any: ...


@runtime_checkable
class Launcher(Protocol):
    """:func:`shardcore.launch`, for backends whose ranks are started from one process (XLA: one
    thread or process per device): run ``fn()`` once per rank and return when all have finished."""

    def launch(self, fn: Callable[[], None], config: ShardConfig) -> None: ...


@dataclass(frozen=True)
class LaunchSpec:
    """How a backend wants the conformance suite to start its ranks (:class:`DeviceLaunch`). Without the
    capability every rank is its own OS process with the torch.distributed environment (torchrun-style).

    ``processes`` 1 with ``world_size`` > 1 means one process serves all devices: either one controller
    drives them (SPMD), or, with ``per_device`` true, the backend's ``run_on_devices(fn)`` calls ``fn(rank)``
    once per device (threads or child processes, e.g. ``xmp.spawn``) and returns when all have finished.
    Cases whose ``group`` differs never share a process (for settings that are global to a process, such
    as XLA's SPMD mode).
    """

    processes: int
    env: dict[str, str] = field(default_factory=dict)
    group: str = ""
    per_device: bool = False


@runtime_checkable
class DeviceLaunch(Protocol):
    """Ranks that are not torchrun-style processes (see :class:`LaunchSpec`)."""

    def launch_spec(self, config: ShardConfig, world_size: int) -> LaunchSpec: ...

    def run_on_devices(self, fn: Callable[[int], None]) -> None:
        """``fn(rank)`` once per local device; returns when all have finished."""
        ...


@runtime_checkable
class ConfigValidation(Protocol):
    """Checks of a config that only the backend knows (its own settings, combinations it refuses).
    :func:`shardcore.shard` calls it before ``apply``, and the conformance suite leaves out the
    cases it refuses. It must not need devices or a process group, so every rank reaches the same
    verdict without talking to the others."""

    def validate(self, config: ShardConfig) -> None:
        """Raise :class:`shardcore.ShardConfigError` naming the key, the value and the fix."""
        ...


@runtime_checkable
class ModelValidation(Protocol):
    """Checks of a config against this model and the other ranks' models, which ``apply`` would otherwise
    meet halfway through sharding (rank 0's weights under ``cpu_ram_efficient_loading``, a model that differs
    between ranks, a meta-device model a mode cannot fill). :func:`shardcore.shard` calls it on every rank,
    after :class:`ConfigValidation` and before ``apply``; it may use collectives, and must end with one
    verdict on every rank (see :func:`shardcore.validate.agree`) so that no rank raises while another
    waits in ``apply``."""

    def validate_model(self, model: nn.Module, plan: Any, config: ShardConfig) -> None:
        """Raise :class:`shardcore.ShardConfigError` naming the key, the value and the fix."""
        ...


@runtime_checkable
class GlobalGradSquares(Protocol):
    """For backends whose ranks do not hold disjoint gradient shards (replication, hybrid sharding): the sum
    of squared gradient entries of the whole model, the same on every rank. Without it the conformance
    suite sums each rank's own entries over ranks."""

    def grad_sq_sum(self, model: nn.Module) -> Any: ...


@runtime_checkable
class TensorParallel(Protocol):
    """``tp_size`` > 1: the weights of the plan's ``tp`` part (``WrapPlan.tp``) are split over the
    innermost dim, named ``"tp"``, of one device mesh, and the other dims shard as without it."""

    def root_mesh(self, config: Any) -> Any:
        """The whole device mesh, dims ``("dp_replicate", "dp_shard", "tp")``, the one ``apply``
        uses (built at the first call: collective); None where ``config.tp_size`` is 1. The Trainer
        gives it to accelerate, whose data loader then deals every rank of one tp group the same rows."""
        ...


@runtime_checkable
class SlicedLoading(Protocol):
    """Every rank reads only its own slices of a FULL checkpoint.

    With it, :func:`shardcore.load` of a FULL checkpoint (``model.safetensors`` or an index of shards) has
    each rank read, through the files' memory maps, only the parts of each tensor (and of the optimizer
    state shaped like them) it keeps. Without it, rank 0 reads the whole file and ``load_full_state_dict``
    spreads it.

    Where :meth:`shards_without_weights` says so, ``apply`` also accepts a model whose parameters are on
    the meta device on every rank (``cpu_ram_efficient_loading``, built with :func:`shardcore.init_empty_weights`):
    it leaves empty shards (:func:`shardcore.empty.materialize_empty`) and calls
    :func:`shardcore.empty.await_weights`, so that no forward runs before the load;
    ``shardcore.from_pretrained`` then never reads the model whole on any rank."""

    def shards_without_weights(self, config: ShardConfig) -> bool:
        """Whether ``apply`` shards a model without weights (see above) under ``config``."""
        ...

    def load_full_slices(self, model: nn.Module, fill: Callable[[str, tuple[slice, ...], Any], None]) -> None:
        """For every parameter and persistent buffer of ``model`` (state-dict names), call
        ``fill(name, index, out)``, which copies ``checkpoint[name][index]`` into the tensor ``out``
        (this rank's part, of ``index``'s shape). No collectives: the caller agrees on errors."""
        ...

    def read_optimizer_slices(
        self, model: nn.Module, osd: dict[str, Any], fill: Callable[[str, tuple[slice, ...], Any], None]
    ) -> Any:
        """This rank's part of a FULL optimizer state dict (keyed by parameter name, the layout of
        ``get_optimizer_state_dict(full_state_dict=True)``) whose tensors are
        :class:`shardcore.checkpoint.full.TensorRef` (file key and global shape): each read with
        ``fill(ref.key, index, out)``, only the rows this rank keeps of state shaped like its
        parameter. No collectives: the caller agrees on errors before the next call."""
        ...

    def load_optimizer_slices(self, model: nn.Module, optimizer: Any, part: Any) -> None:
        """Load what :meth:`read_optimizer_slices` returned into ``optimizer``. Collective."""
        ...


@runtime_checkable
class ConfigResolved(Protocol):
    """One registered name, implementations chosen by the config (XLA FSDP or SPMD, by ``xla_fsdp_v2``).
    :func:`shardcore.get_backend` returns this *resolver*; wherever a config is known (``shard()``, ``launch``,
    ``from_pretrained``, the conformance matrix), :func:`shardcore.backend.for_config` calls ``resolve(config)``
    and checks what it returns (a complete backend, not a resolver; ShardConfigError if none serves the
    config) like any loaded backend. A resolver needs only ``name``, ``install_hint``, ``supported_keys``
    (every implementation's) and ``is_available``, and declares nothing but :data:`BEFORE_RESOLVE` (which
    it delegates); a sharded model's handle holds the implementation."""

    def resolve(self, config: ShardConfig) -> Any: ...


@runtime_checkable
class CompileCounter(Protocol):
    """Compiling backends: how many graphs this process has compiled so far (the conformance suite
    and the tests check that steps after warm-up compile nothing new)."""

    def compile_count(self) -> int: ...


@runtime_checkable
class RenamesParameters(Protocol):
    """Backends whose wrappers rename or flatten parameters, so that checkpoints can still speak
    the original names."""

    def tied_aliases(self, model: nn.Module) -> dict[str, str]:
        """Original parameter name -> the name it is tied to, for every tie the wrapped model keeps."""
        ...

    def full_state_dict_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Original name -> unsharded shape, for every entry of :meth:`Backend.full_state_dict`,
        without gathering anything."""
        ...

    def original_names(self, model: nn.Module) -> dict[str, list[str]]:
        """Each parameter's name in the wrapped ``model`` -> the original parameter names it holds
        (one, or several where the wrapper flattened them into one), for code that decides per original
        parameter (the Trainer's weight-decay groups)."""
        ...


#: every optional capability, in the order the docs list them
CAPABILITIES: tuple[type, ...] = (
    ShardedCheckpoints,
    AsyncShardedCheckpoints,
    AsyncFullCheckpoints,
    StepEnd,
    GradClipping,
    GradSyncControl,
    Launcher,
    DeviceLaunch,
    ConfigValidation,
    ModelValidation,
    GlobalGradSquares,
    SlicedLoading,
    TensorParallel,
    CompileCounter,
    RenamesParameters,
    ConfigResolved,
)

BEFORE_RESOLVE: tuple[type, ...] = (ConfigValidation, Launcher, DeviceLaunch)


def members(protocol: type) -> list[str]:
    """The methods and attributes a protocol requires, in definition order."""
    names = [n for n in vars(protocol) if not n.startswith("_")]
    names += [n for n in getattr(protocol, "__annotations__", {}) if not n.startswith("_") and n not in names]
    return names


def declared(backend: Any) -> list[type]:
    """The capabilities ``backend`` declares (names among its classes' bases)."""
    return [c for c in CAPABILITIES if c in type(backend).__mro__]


def check_backend(backend: Any, name: str) -> None:
    """Refuse a backend that breaks the contract (see the module docstring); ``name`` is how the
    user named it."""
    from .backend import Backend

    problems, mro = [], type(backend).__mro__
    resolver = ConfigResolved in mro  # a name, not an implementation: resolve() gives that
    required = ["name", "install_hint", "supported_keys", "is_available"] if resolver else members(Backend)
    extra = [c.__name__ for c in declared(backend) if resolver and c not in (ConfigResolved, *BEFORE_RESOLVE)]
    if extra:
        problems.append(f"it declares ConfigResolved and {', '.join(extra)}, which only what resolve() returns may")
    missing = [m for m in required if not hasattr(backend, m)]
    if missing:
        problems.append(f"it lacks the required Backend member(s) {', '.join(missing)}")
    for cap in CAPABILITIES:
        defined = [m for m in members(cap) if callable(getattr(backend, m, None)) and _owner(mro, m) is not cap]
        if cap in mro and len(defined) < len(members(cap)):
            absent = [m for m in members(cap) if m not in defined]
            problems.append(f"it declares {cap.__name__} but does not define {', '.join(absent)}")
        elif cap not in mro and defined:
            problems.append(
                f"it defines {', '.join(defined)} of {cap.__name__} without declaring it (add "
                f"shardcore.capabilities.{cap.__name__} to its bases, or rename the method)"
            )
    if "state_dict_type" in getattr(backend, "supported_keys", ()) and ShardedCheckpoints not in mro and not resolver:
        problems.append(
            "its supported_keys include state_dict_type (SHARDED_STATE_DICT) but it does not declare ShardedCheckpoints"
        )
    tp = {"tp_size", "tp_plan"} & set(getattr(backend, "supported_keys", ()))
    if tp and TensorParallel not in mro and not resolver:
        problems.append(f"its supported_keys include {', '.join(sorted(tp))} but it does not declare TensorParallel")
    if problems:
        raise BackendUnavailableError(
            f"shardcore backend {name!r} ({type(backend).__module__}.{type(backend).__qualname__}) breaks the backend "
            f"contract: {'; '.join(problems)}. See shardcore.Backend and shardcore.capabilities."
        )


def _owner(mro: tuple[type, ...], member: str) -> type | None:
    """The class of ``mro`` that defines ``member``."""
    for cls in mro:
        if member in vars(cls):
            return cls
    return None
