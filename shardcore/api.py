"""``shard()`` and the per-model handle. Thin: parse, plan, pick the backend, delegate."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from .backend import Backend, World, resolve_backend
from .config import ShardConfig, parse_config
from .errors import AlreadyShardedError, ShardConfigError, ShardcoreError
from .plan import WrapPlan, build_plan

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


def shard(model: nn.Module, config: Any = None, *, backend: str | Backend | None = None) -> nn.Module:
    """Shard ``model`` in place and return the module to train.

    ``config`` is anything :func:`shardcore.parse_config` reads: a dict of ``fsdp_config`` keys, a
    JSON or accelerate YAML path, a ``TrainingArguments`` or a ``ShardConfig``. ``backend`` overrides
    the backend the config selects (a registered name, ``"module:Class"``, or an instance).

    Build the optimizer on ``model.parameters()`` *after* this call: parameters are replaced by
    their sharded form.
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
    _check_model_against_config(model, cfg)
    chosen = resolve_backend(cfg, backend)
    plan = build_plan(model, cfg)
    if (cfg.activation_checkpointing or cfg.xla_fsdp_grad_ckpt) and not plan.units:
        key = "activation_checkpointing" if cfg.activation_checkpointing else "xla_fsdp_grad_ckpt"
        raise ShardConfigError(
            key,
            f"is true but auto_wrap_policy {cfg.auto_wrap_policy} gives no units to checkpoint. Use "
            "TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP, or drop the key.",
        )
    if cfg.activation_checkpointing or cfg.xla_fsdp_grad_ckpt:
        _disable_kv_cache(model)
    log.info("shardcore: %s backend, %d units\n%s", chosen.name, len(plan.units), plan.describe())
    out = chosen.apply(model, plan, cfg)
    h = ShardedModel(chosen, cfg, plan)
    object.__setattr__(out, _HANDLE_ATTR, h)  # plain attribute, bypassing nn.Module registration
    if out is not model:
        object.__setattr__(model, _HANDLE_ATTR, h)
    return out


def handle(model: nn.Module) -> ShardedModel:
    """The :class:`ShardedModel` handle of a model returned by :func:`shard`."""
    h = getattr(model, _HANDLE_ATTR, None)
    if h is None:
        raise ShardcoreError(
            f"{type(model).__name__} was not sharded by shardcore.shard(); call shard(model, config) first."
        )
    return h


def _check_model_against_config(model: nn.Module, cfg: ShardConfig) -> None:
    if cfg.activation_checkpointing or cfg.xla_fsdp_grad_ckpt:
        key = "activation_checkpointing" if cfg.activation_checkpointing else "xla_fsdp_grad_ckpt"
        # Transformers 5 renamed is_gradient_checkpointing; read the old name only where the new is absent
        attr = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
        if getattr(model, attr, False) is True:
            raise ShardConfigError(
                key,
                f"is true but {type(model).__name__} already has gradient checkpointing enabled "
                "(gradient_checkpointing_enable()); setting both raises an error (Transformers FSDP "
                f"guide). Call model.gradient_checkpointing_disable() or drop {key}.",
            )


def _disable_kv_cache(model: nn.Module) -> None:
    """A KV cache filled in forward is filled again when a checkpointed layer recomputes, which
    corrupts it; Transformers turns ``use_cache`` off for its own gradient checkpointing, and so do we."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False):
        log.info("shardcore: setting %s.config.use_cache = False (activation checkpointing)", type(model).__name__)
        cfg.use_cache = False
