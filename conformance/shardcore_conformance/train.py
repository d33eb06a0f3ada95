"""The one training loop both the reference and the sharded run execute.

The reference is plain single-device PyTorch; the sharded run is ``shardcore.shard`` with the
backend under test. Both start from the same seed and see the same global batches: the sharded
run's backend picks each rank's part of the batch (``local_batch``) and reduces scalars
(``all_reduce_sum``), the reference uses :class:`LocalRuntime`, which does neither.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .cases import Case
from .models import build_model, loss_fn, make_batches


class LocalRuntime:
    """Single-device stand-in for a backend's batch and reduction hooks."""

    world_size = 1

    def local_batch(self, batch):
        return batch

    def all_reduce_sum(self, t):
        return t

    def full_state_dict(self, model: nn.Module):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def local_grad_sq_sum(model: nn.Module) -> torch.Tensor:
    """Sum of squared gradient entries this rank holds (its shards, for a sharded model)."""
    total = None
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "to_local"):
            g = g.to_local()
        s = g.detach().float().pow(2).sum()
        total = s if total is None else total + s
    if total is None:
        return torch.zeros(())
    return total


def run_case(case: Case, backend: Any | None) -> dict[str, Any]:
    """Train ``case`` and return per-step losses, gradient norms and the final full parameters.

    ``backend`` None runs the single-device reference; otherwise the backend name (or
    ``module:Class``) given to ``shardcore.shard``.
    """
    model = build_model(case.model, case.seed)
    if backend is None:
        runtime: Any = LocalRuntime()
        world_size = 1
    else:
        import shardcore

        model = shardcore.shard(model, case.config, backend=backend)
        runtime = shardcore.handle(model).backend
        world_size = runtime.world().size
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.01)
    compute_dtype = _reference_compute_dtype(case) if backend is None else None
    losses, grad_norms = [], []
    for batch in make_batches(case.model, case.steps, case.global_batch, case.seed):
        if compute_dtype is None:
            loss = loss_fn(case.model, model, runtime.local_batch(batch))
            loss.backward()
        else:
            loss = _low_precision_step(case, model, batch, compute_dtype)
        gsq = runtime.all_reduce_sum(local_grad_sq_sum(model).to(loss.device))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_end = getattr(runtime, "step_end", None)  # lazy-tensor backends cut the step's graph here
        if step_end is not None:
            step_end()
        losses.append(float(runtime.all_reduce_sum(loss.detach()) / world_size))
        grad_norms.append(float(gsq.sqrt()))
    state = runtime.full_state_dict(model)
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": {k: v.detach().float().cpu() for k, v in state.items()},
    }


def _reference_compute_dtype(case: Case) -> torch.dtype | None:
    """The parameter dtype a mixed-precision case computes in (None: full precision)."""
    from shardcore import parse_config

    mp = parse_config(case.config).mixed_precision
    if mp is None or mp.param_dtype is None:
        return None
    return getattr(torch, mp.param_dtype)


def _low_precision_step(case: Case, model: nn.Module, batch, dtype: torch.dtype) -> torch.Tensor:
    """Single-device mixed precision as FSDP2 does it: fp32 master parameters, forward and backward
    on a copy cast to ``dtype``, gradients cast back to fp32 for the optimizer step."""
    import copy

    low = copy.deepcopy(model).to(dtype)
    # FSDP2's MixedPrecisionPolicy casts floating-point forward inputs too (cast_forward_inputs)
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}
    loss = loss_fn(case.model, low, batch)
    loss.backward()
    for p, q in zip(model.parameters(), low.parameters()):
        if q.grad is not None:
            p.grad = q.grad.float()
    return loss
