"""``shard()`` and the per-model handle. Thin: parse, plan, pick the backend, delegate."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from .backend import Backend, World, resolve_backend
from .capabilities import StepEnd
from .config import ShardConfig, parse_config
from .errors import AlreadyShardedError, ShardcoreError
from .integrations import peft
from .plan import WrapPlan, build_plan
from .validate import validate

log = logging.getLogger(__name__)

_HANDLE_ATTR = "_shardcore_handle"


@dataclass(frozen=True)
class ShardedModel:
    """What shardcore knows about a sharded model: the backend, config and plan it was sharded with.

    Get it with :func:`handle`; checkpoint functions use it to reach the right backend.
    """

    backend: Backend
    config: ShardConfig
    plan: WrapPlan

    def world(self) -> World:
        return self.backend.world()

    # -- the training-loop surface: what a script needs, the same on every backend ----------------
    @property
    def rank(self) -> int:
        """This rank's index (``torch.distributed.get_rank()``, accelerate's ``process_index``).
        0 under XLA SPMD, where one process drives every device."""
        return self.backend.world().rank

    @property
    def world_size(self) -> int:
        """How many ranks split each global batch (1 under XLA SPMD: one controller)."""
        return self.backend.world().size

    @property
    def device(self) -> Any:
        """This rank's device: where its batch goes."""
        return self.backend.world().device

    @property
    def is_main_process(self) -> bool:
        """Whether this is rank 0, the one that logs and writes files."""
        return self.rank == 0

    def local_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a global batch (the same dict on every rank), on its device: its
        slice along dim 0, or under SPMD the whole batch sharded across the devices."""
        return self.backend.local_batch(batch)

    def step_end(self) -> None:
        """Call after ``optimizer.step()`` (and ``zero_grad``). Lazy-tensor backends cut and run
        the step's graph here (XLA: ``torch_xla.sync()``, serialized across CPU device threads);
        a no-op elsewhere."""
        if isinstance(self.backend, StepEnd):
            self.backend.step_end()

    def reduce(self, tensor: Any, reduction: str = "mean") -> Any:
        """``tensor`` summed or averaged over ranks (accelerate's ``reduce``), for logging: a
        collective, call it on every rank. Under SPMD values are already global."""
        if reduction not in ("mean", "sum"):
            raise ShardcoreError(f"shardcore reduce: reduction={reduction!r}; use 'mean' or 'sum'.")
        total = self.backend.all_reduce_sum(tensor.detach())
        return total / self.world_size if reduction == "mean" else total

    def barrier(self) -> None:
        """Wait until every rank gets here (``torch.distributed.barrier``, accelerate's
        ``wait_for_everyone``)."""
        self.backend.barrier()


def shard(model: nn.Module, config: Any = None, *, backend: str | Backend | None = None) -> nn.Module:
    """Shard ``model`` in place and return the module to train.

    ``config`` is anything :func:`shardcore.parse_config` reads: a dict of ``fsdp_config`` keys, a
    JSON or accelerate YAML path, a ``TrainingArguments`` or a ``ShardConfig``. ``backend`` overrides
    the backend the config selects (a registered name, ``"module:Class"``, or an instance).

    Build the optimizer on ``model.parameters()`` *after* this call: parameters are replaced by
    their sharded form.

    Every check of the config against the model, the wrap plan and the backend (its supported keys,
    :func:`shardcore.validate.validate` with the backend's own checks) runs before the model is
    touched, and every rank reaches the same verdict: a config mistake never leaves a model half
    sharded or one rank waiting for another.

    Process-wide effects: on several torch.distributed ranks, a process group shardcore creates is
    destroyed at exit (a group the script created is left alone), and ``sys.excepthook`` is wrapped
    once, so that an uncaught failed collective ends the process with a DistributedSetupError naming
    the lost rank (other exceptions pass through to the previous hook unchanged). Set the
    environment variable ``SHARDCORE_EXCEPTHOOK=0`` to leave ``sys.excepthook`` alone.
    """
    if not isinstance(model, nn.Module):
        raise ShardcoreError(f"shardcore.shard: expected a torch.nn.Module, got {type(model).__name__}.")
    if getattr(model, _HANDLE_ATTR, None) is not None:
        raise AlreadyShardedError(
            f"shardcore.shard: this {type(model).__name__} is already sharded (backend "
            f"{getattr(model, _HANDLE_ATTR).backend.name!r}). Call shard() once per model; build a new "
            "model to shard it differently."
        )
    cfg = parse_config(config)
    chosen = resolve_backend(cfg, backend)
    plan = build_plan(model, cfg)
    validate(model, plan, cfg, chosen)
    if cfg.activation_checkpointing or cfg.xla_fsdp_grad_ckpt:
        _disable_kv_cache(model)
    if peft.is_peft_model(model):
        peft.remember_keys(model)
    log.info("shardcore: %s backend, %d units\n%s", chosen.name, len(plan.units), plan.describe())
    out = chosen.apply(model, plan, cfg)
    h = ShardedModel(chosen, cfg, plan)
    object.__setattr__(out, _HANDLE_ATTR, h)  # plain attribute, bypassing nn.Module registration
    if out is not model:
        object.__setattr__(model, _HANDLE_ATTR, h)
    return out


def handle(model: nn.Module) -> ShardedModel:
    """The :class:`ShardedModel` handle of a model returned by :func:`shard`."""
    h = handle_or_none(model)
    if h is None:
        raise ShardcoreError(
            f"{type(model).__name__} was not sharded by shardcore.shard(); call shard(model, config) first."
        )
    return h


def handle_or_none(model: nn.Module) -> ShardedModel | None:
    """The handle of a sharded model, None for a model :func:`shard` did not return."""
    return getattr(model, _HANDLE_ATTR, None)


def _disable_kv_cache(model: nn.Module) -> None:
    """A KV cache filled in forward is filled again when a checkpointed layer recomputes, which
    corrupts it; Transformers turns ``use_cache`` off for its own gradient checkpointing, and so do we."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False):
        log.info("shardcore: setting %s.config.use_cache = False (activation checkpointing)", type(model).__name__)
        cfg.use_cache = False
