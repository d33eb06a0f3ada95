"""Training-loop functions that take the model (as accelerate's do): gradient clipping, gradient
accumulation without communication, and starting a script's ranks. The per-rank helpers (batch
slicing, step end, reductions, barrier) are methods of the handle, :class:`shardcore.ShardedModel`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .api import ShardedModel, handle_or_none
from .backend import Backend, resolve_backend
from .capabilities import GradClipping, GradSyncControl, Launcher
from .config import parse_config
from .errors import ShardcoreError

log = logging.getLogger(__name__)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model`` in place so that their total norm is at most ``max_norm``,
    and return that total norm (before clipping), exactly as ``torch.nn.utils.clip_grad_norm_``
    would on the unsharded model.

    On a sharded model each rank holds only its shards' gradients, so the norm is computed over
    all ranks (a collective: call it on every rank, after backward and before ``optimizer.step()``).
    ``norm_type`` may be ``inf``. Frozen parameters and parameters without a gradient do not count.
    On XLA the returned norm is a lazy tensor: read it after ``step_end()``.
    """
    max_norm, norm_type = _norm_args(max_norm, norm_type)
    h: ShardedModel | None = handle_or_none(model)
    if h is None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    if not isinstance(h.backend, GradClipping):
        raise ShardcoreError(
            f"shardcore.clip_grad_norm_: the {h.backend.name!r} backend does not implement gradient clipping "
            "(a clip_grad_norm_(model, max_norm, norm_type) method that computes the norm over every rank's "
            "shards). torch.nn.utils.clip_grad_norm_ would clip each rank by its own shards' norm, which is "
            "wrong; use a backend that supports clipping, or train without it."
        )
    return h.backend.clip_grad_norm_(model, max_norm, norm_type)


def _norm_args(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    try:
        max_norm, norm_type = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise ShardcoreError(
            f"shardcore.clip_grad_norm_: max_norm={max_norm!r}, norm_type={norm_type!r}; both must be numbers "
            "(norm_type may be 'inf')."
        ) from None
    if math.isnan(max_norm) or max_norm < 0:
        raise ShardcoreError(
            f"shardcore.clip_grad_norm_: max_norm={max_norm!r}; use a number >= 0 (the Trainer's default is 1.0)."
        )
    if math.isnan(norm_type) or norm_type <= 0:
        raise ShardcoreError(
            f"shardcore.clip_grad_norm_: norm_type={norm_type!r}; use a p > 0 (2.0 for the L2 norm) or 'inf'."
        )
    return max_norm, norm_type


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them across ranks, for every micro-batch but the last
    of an optimizer step::

        for i, micro in enumerate(micro_batches):
            with shardcore.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (loss_fn(model, micro) / len(micro_batches)).backward()

    The backward after the context reduces what was accumulated: one reduction per optimizer step
    instead of one per micro-batch. What each backend does:

    * FSDP2: ``set_requires_gradient_sync(False)``; gradients accumulate unsharded and unreduced.
    * XLA FSDP: ``XlaFullyShardedDataParallel.no_sync()``; full (unsharded) gradients accumulate, so
      memory grows by one copy of the gradients until the step.
    * XLA SPMD: nothing to do; the compiler places the reductions.
    * A backend without the capability, or an unsharded model: gradients are reduced every
      micro-batch (correct, with redundant communication).
    """
    h: ShardedModel | None = handle_or_none(model)
    if h is None or not isinstance(h.backend, GradSyncControl):
        if h is not None:
            log.debug("shardcore.no_sync: the %r backend reduces gradients on every micro-batch", h.backend.name)
        yield
        return
    with h.backend.no_sync(model):
        yield


def launch(
    fn: Callable[..., Any], config: Any = None, *, backend: str | Backend | None = None, args: tuple = ()
) -> None:
    """Run ``fn(*args)`` once per rank of the backend that ``config`` selects, the way that backend's
    ranks are started, and return when all have finished.

    With torchrun or ``accelerate launch`` the launcher already started one process per rank, so
    this simply calls ``fn``. XLA FSDP runs one rank per device from a single process: ``fn`` runs
    on every local device (``torch_xla``'s ``xmp.spawn``; on CPU, ``CPU_NUM_DEVICES`` threads of this process), so
    the same script runs unchanged with ``python script.py``. XLA SPMD has one controller: ``fn``
    runs once. Like ``torch_xla.launch``, ``fn`` and ``args`` must be picklable (a module-level
    function), and the script must call this under ``if __name__ == "__main__":``.
    """
    cfg = parse_config(config)
    chosen = resolve_backend(cfg, backend)
    call = functools.partial(fn, *args)
    if isinstance(chosen, Launcher):
        chosen.launch(call, cfg)
    else:
        call()
