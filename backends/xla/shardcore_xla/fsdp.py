"""XLA FSDP (``xla_fsdp_v2: false``): ``XlaFullyShardedDataParallel`` on every plan unit, then on the root.

One device per process (TPU, ``xmp.spawn``) or per thread (several CPU devices, see cpu.py). The
wrapping decision is the plan's: torch_xla's own auto-wrap machinery is handed a policy that says
yes exactly to the plan's unit modules. SPMD FSDPv2 (spmd.py) wraps with the same policy and unit
wrapper.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch
from torch import nn

from shardcore.config import ShardConfig
from shardcore.errors import DistributedSetupError
from shardcore.plan import WrapPlan
from shardcore.ties import ties_kept

from . import cpu, unit_fix


def device_threads(config: ShardConfig) -> cpu.DeviceThreads | None:
    """The device-thread group when XLA FSDP runs on several CPU devices (None elsewhere: one device,
    or TPU with one device per process), after checking the runtime has the CPU recipe. Idempotent."""
    import torch_xla.runtime as xr

    if os.environ.get("PJRT_DEVICE") == "CPU":
        cpu.prepare(int(os.environ.get("CPU_NUM_DEVICES", "1")))  # only takes effect before the runtime starts
    n = xr.world_size()
    if xr.device_type() != "CPU" or n == 1:
        return None
    cpu.check(n)
    cpu.thread_local_checkpoint_status()
    return cpu.device_threads(n, config.timeout)


# ---------------------------------------------------------------- every device starts from the same weights


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def check_same_model(model: nn.Module, threads: cpu.DeviceThreads) -> None:
    """Before :func:`start_from_device0`: every device's model has device 0's names and shapes, and
    real tensors. Collective; every device thread sees every layout and raises the same error."""
    import torch_xla.runtime as xr

    mine = {k: (tuple(t.shape), t.is_meta) for k, t in _tensors(model).items()}
    layouts = threads.exchange(xr.global_ordinal(), mine)
    for rank, layout in enumerate(layouts[1:], start=1):
        for k, (shape, is_meta) in layout.items():
            src = layouts[0].get(k)
            if src is None or src[0] != shape or is_meta:
                got = "missing" if src is None else src[0]
                raise DistributedSetupError(
                    f"shardcore xla: device {rank}'s model differs from device 0's at {k!r} (shape "
                    f"{shape}{', on the meta device' if is_meta else ''}; device 0: {got}). Build "
                    "the same model with real weights on every device (for meta-device models, set "
                    "cpu_ram_efficient_loading)."
                )


def start_from_device0(model: nn.Module, threads: cpu.DeviceThreads) -> None:
    """Give every device thread device 0's initial weights (FSDP1's ``sync_module_states``). The
    threads share one process and so one global RNG: seeding and building the model in each of
    them interleaves their draws, and identical seeds do not give identical weights.
    :func:`check_same_model` has checked that the models agree."""
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    mine = _tensors(model)
    src = threads.exchange(rank, mine)[0]
    if rank != 0:
        with torch.no_grad():
            for k, t in mine.items():
                t.copy_(src[k])
    threads.wait()  # device 0 waits for the copies


# ---------------------------------------------------------------- wrapping


def wrap(model: nn.Module, plan: WrapPlan, kwargs: dict[str, Any], grad_ckpt: bool, fixes: bool) -> nn.Module:
    """The plan's units, then the root, wrapped with ``kwargs`` (torch_xla's own class, or with
    ``fixes`` shardcore's fixes for units that return several tensors, unit_fix.py)."""
    import torch_xla

    if fixes:
        fsdp = unit_fix.fsdp_class()
    else:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as fsdp
    return fsdp(
        to_device_keeping_ties(model, torch_xla.device()),
        auto_wrap_policy=plan_policy(model, plan),
        auto_wrapper_callable=unit_wrapper(fsdp, grad_ckpt, fixes),
        **kwargs,
    )


def plan_policy(model: nn.Module, plan: WrapPlan) -> Callable[..., bool]:
    unit_ids = {id(m) for m in plan.modules(model)}

    def policy(module: nn.Module, recurse: bool, **_: Any) -> bool:
        # recurse everywhere; wrap exactly the plan's units (children first, as recursive_wrap goes)
        return True if recurse else id(module) in unit_ids

    return policy


def unit_wrapper(wrapper_cls: type, grad_ckpt: bool, fixes: bool) -> Callable[..., nn.Module]:
    """What wraps each plan unit: ``wrapper_cls``, around torch_xla's ``checkpoint_module`` of the
    unit when ``xla_fsdp_grad_ckpt`` is on (the Trainer's ``auto_wrapper_callable``)."""
    from torch_xla.distributed.fsdp import checkpoint_module

    def wrap(m: nn.Module, *args: Any, **kw: Any) -> nn.Module:
        if not grad_ckpt:
            return wrapper_cls(m, *args, **kw)
        if fixes:
            kw = unit_fix.checkpointed_unit_kwargs(kw)  # XLA FSDP's None-gradient crash (unit_fix.py)
        return wrapper_cls(checkpoint_module(m), *args, **kw)

    return wrap


def to_device_keeping_ties(model: nn.Module, device: Any) -> nn.Module:
    """``model.to(device)`` with tied weights tied again: moving a model to an XLA device disconnects
    them (the Trainer re-ties them with ``tie_weights()`` for the same reason); this works for any model."""
    with ties_kept(model):
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            model.to_empty(device=device)  # cpu_ram_efficient_loading, off rank 0: the values come later
        else:
            model.to(device)
    return model


# ---------------------------------------------------------------- training


def local_slice(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice (along dim 0) of a global batch, on its XLA device."""
    import torch_xla

    out = {}
    for k, v in batch.items():
        n = v.shape[0] // size
        out[k] = v[rank * n : (rank + 1) * n].to(torch_xla.device())
    return out


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """XlaFullyShardedDataParallel.clip_grad_norm_'s algorithm (each rank's shard norm, reduced over
    ranks inside the step's graph: max for ``inf``, else the sum of p-th powers), without its ``inf``
    bug: it takes Python's ``max()`` over the per-gradient maxima, which compares lazy tensors, so
    every comparison runs a graph on the spot and the traced graph then depends on which shard holds
    the largest entry. Ranks trace different step graphs, compile different modules, and their
    collectives never meet (XLA aborts the process after 10 s). Here the maximum is a tensor op."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        local = torch.zeros((), device=torch_xla.device())
    elif math.isinf(norm_type):
        local = torch.stack([g.abs().max() for g in grads]).max()
    else:
        local = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type
        )
    total = local
    if xr.world_size() > 1:
        # the wrapper's own all_reduce, with the layout pinning it was built with
        if math.isinf(norm_type):
            total = model.all_reduce_op(xm.REDUCE_MAX, local)
        else:
            total = model.all_reduce_op(xm.REDUCE_SUM, local**norm_type) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def check_float32_parameters(model: nn.Module) -> None:
    """torch_xla 2.9's XLA FSDP shards float32 parameters only (else a raw ``TypeError: only fp32
    parameters are supported`` from inside its constructor): a bf16 model, or a bf16 base with fp32
    LoRA adapters, is refused here by name."""
    from shardcore.errors import WrapPlanError

    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise WrapPlanError(
                "parameter dtypes",
                f"XLA FSDP (xla_fsdp_v2: false) shards float32 parameters only, and {name} is "
                f"{str(p.dtype).removeprefix('torch.')}. Keep the parameters in float32 and compute in bf16 with "
                "xla_fsdp_settings: {compute_dtype: bfloat16}, or shard with SPMD (xla_fsdp_v2: true), which "
                "takes any dtype.",
            )
