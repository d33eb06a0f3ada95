"""SPMD FSDPv2 (``xla_fsdp_v2: true``): ``SpmdFullyShardedDataParallel`` over a mesh of every device.

The mesh has axes ``("fsdp", "model")``; one process drives all devices, inputs are sharded along the
batch on the ``fsdp`` axis, and Hugging Face outputs are sharded the way the Trainer's
``shard_output`` does. The units are the plan's, wrapped with XLA FSDP's policy (fsdp.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardcore.config import ShardConfig
from shardcore.errors import ShardConfigError, ShardcoreError
from shardcore.plan import WrapPlan
from shardcore.validate import has_meta_tensors

from .fsdp import plan_policy, to_device_keeping_ties, unit_wrapper


def check_model(model: nn.Module, config: ShardConfig) -> None:
    """What SPMD cannot fill: one process drives every device, so there are no other ranks to take
    rank 0's weights from. One controller, so one verdict without collectives."""
    if config.cpu_ram_efficient_loading and has_meta_tensors(model):
        raise ShardConfigError(
            "cpu_ram_efficient_loading",
            "is true, but under SPMD (xla_fsdp_v2: true) one process drives every device, so it is rank 0 and "
            "must hold the real weights; this model has tensors on the meta device. Load the weights in it.",
        )


def mesh(existing: Any = None) -> Any:
    """The process's SPMD mode and its global mesh: every device on ``fsdp`` (``existing`` if set)."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()
    if existing is not None:
        return existing
    n = xr.global_runtime_device_count()
    out = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    xs.set_global_mesh(out)
    return out


def wrap(model: nn.Module, plan: WrapPlan, mesh: Any, grad_ckpt: bool, kwargs: dict[str, Any]) -> nn.Module:
    import torch_xla
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    return FSDPv2(
        to_device_keeping_ties(model, torch_xla.device()),
        mesh=mesh,
        shard_output=shard_output,
        auto_wrap_policy=plan_policy(model, plan),
        auto_wrapper_callable=unit_wrapper(FSDPv2, grad_ckpt, fixes=False),
        **kwargs,
    )


def shard_batch(batch: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """The whole global batch on the XLA device, sharded along dim 0 on the mesh's ``fsdp`` axis."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    out = {}
    for k, v in batch.items():
        t = v.to(torch_xla.device())
        xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))
        out[k] = t
    return out


def shard_output(output: Any, mesh: Any) -> None:
    """Shard a forward output along the batch on ``fsdp``, as the Trainer's FSDPv2 ``shard_output``:
    a tensor, the first element of a tuple, or a Hugging Face output's ``logits``."""
    import torch_xla.distributed.spmd as xs

    real = None
    if isinstance(output, torch.Tensor):
        real = output
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        real = output[0]
    elif hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        real = output.logits
    elif hasattr(output, "last_hidden_state") and isinstance(output.last_hidden_state, torch.Tensor):
        real = output.last_hidden_state
    if real is None:
        raise ShardcoreError(
            f"shardcore xla (xla_fsdp_v2): cannot find the tensor to shard in a {type(output).__name__} "
            "output; return a tensor, a tuple starting with one, or an object with .logits."
        )
    xs.mark_sharding(real, mesh, ("fsdp",) + (None,) * (real.dim() - 1))


def like_spmd_param(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` on the XLA device with the same SPMD sharding as ``p``."""
    import torch_xla
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    t = value.to(torch_xla.device(), p.dtype)
    xs.mark_sharding(t, xs.get_global_mesh(), _prepare_spmd_partition_spec(t, shard_maximal=True))
    return t
