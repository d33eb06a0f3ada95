"""Who does the collective work of a checkpoint, and how rank 0's file work reaches every rank.

A model sharded by shardcore saves through its backend; any other model gets :class:`LocalRuntime`,
so ``save`` and ``load`` have one code path and plain PyTorch models can share the FULL format.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..backend import World
from ..capabilities import ShardedCheckpoints
from ..config import ShardConfig, parse_config
from ..errors import CheckpointError, ShardcoreError

FULL = "FULL_STATE_DICT"
SHARDED = "SHARDED_STATE_DICT"


class LocalRuntime:
    """The checkpoint side of a backend for a model that shardcore did not shard (one device)."""

    name = "single-device"

    def world(self) -> World:
        return World(0, 1, torch.device("cpu"))

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_reduce_sum(self, tensor: Any) -> Any:
        return tensor

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        model.load_state_dict(state_dict, strict=True)

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return _to_cpu(osd)

    def load_full_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, osd)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def runtime_of(model: nn.Module) -> tuple[Any, ShardConfig | None]:
    """The backend that sharded ``model`` and its config, or :class:`LocalRuntime` and None."""
    from ..api import handle_or_none

    if not isinstance(model, nn.Module):
        raise CheckpointError(f"shardcore checkpoints: expected a torch.nn.Module, got {type(model).__name__}.")
    h = handle_or_none(model)
    if h is None:
        return LocalRuntime(), None
    return h.backend, h.config


def sharded_checkpoints(runtime: Any, verb: str, path: Any) -> ShardedCheckpoints:
    if not isinstance(runtime, ShardedCheckpoints):
        raise CheckpointError(
            f"shardcore.{verb}({str(path)!r}): the {runtime.name!r} backend does not implement SHARDED_STATE_DICT "
            "checkpoints (shardcore.capabilities.ShardedCheckpoints). Use state_dict_type='FULL_STATE_DICT'."
        )
    return runtime


def resolve_state_dict_type(value: str | None, cfg: ShardConfig | None) -> str:
    if value is None:
        return cfg.state_dict_type if cfg is not None else FULL
    # the config's own validator: the same spellings are accepted and the same error names the key
    return parse_config({"state_dict_type": value}).state_dict_type


def on_rank0(runtime: Any, fn: Callable[[], Any], *, share: bool = True) -> Any:
    """Run ``fn`` on rank 0 only; every rank returns its result (rank 0's alone where ``share`` is
    false: the others get None, and only the verdict travels) or raises its error.

    The other ranks wait in the broadcast, so a failure on rank 0 stops every rank instead of
    leaving them waiting in a later collective.
    """
    outcome: tuple[bool, Any] = (True, None)
    error: BaseException | None = None
    result = None
    if runtime.world().rank == 0:
        try:
            result = fn()
            outcome = (True, result if share else None)
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised below
            error = e
            outcome = (False, f"{type(e).__name__}: {e}" if not isinstance(e, ShardcoreError) else str(e))
    ok, value = runtime.broadcast_object(outcome)
    if error is not None:
        raise error
    if not ok:
        raise CheckpointError(f"rank 0 failed: {value}")
    return value if share else result
