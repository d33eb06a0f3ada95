"""FSDP2: ``fully_shard`` on each plan unit, then on the root, over a 1-D mesh of the whole world.

NCCL on CUDA, gloo on CPU. The shape follows torchtitan's ``parallelize_llama``: activation
checkpointing is applied to a unit before it is sharded, and one set of ``fully_shard`` keyword
arguments is used for every unit.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardcore.backend import World
from shardcore.config import ShardConfig
from shardcore.distributed import ensure_process_group
from shardcore.errors import DistributedSetupError
from shardcore.plan import WrapPlan

log = logging.getLogger(__name__)


class FSDP2Backend:
    name = "fsdp2"
    install_hint = "pip install 'torch>=2.6' && pip install -e backends/fsdp2"
    supported_keys = frozenset(
        {
            "reshard_after_forward",
            "auto_wrap_policy",
            "transformer_layer_cls_to_wrap",
            "min_num_params",
            "cpu_offload",
            "activation_checkpointing",
            "mixed_precision",
            "timeout",
        }
    )

    def __init__(self) -> None:
        self._mesh = None

    # -- protocol -------------------------------------------------------------------------------
    def is_available(self) -> tuple[bool, str]:
        if not dist.is_available():
            return False, "this torch build has no torch.distributed"
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return False, f"torch {torch.__version__} has no public torch.distributed.fsdp.fully_shard (needs >= 2.6)"
        return True, "cuda + nccl" if torch.cuda.is_available() else "cpu + gloo"

    def apply(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = self.mesh(config)
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward}
        if config.mixed_precision is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(**config.mixed_precision.torch_dtypes())
        if config.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for unit in plan.modules(model):
            if config.activation_checkpointing:
                checkpoint_forward(unit)
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def world(self) -> World:
        if not dist.is_initialized():
            return World(0, 1, self._device())
        return World(dist.get_rank(), dist.get_world_size(), self._device())

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size() > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
        return tensor

    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's contiguous slice (along dim 0) of a global batch, on this rank's device."""
        w = self.world()
        out = {}
        for k, v in batch.items():
            if v.shape[0] % w.size:
                raise DistributedSetupError(
                    f"shardcore: batch field {k!r} has {v.shape[0]} rows, not divisible by world size "
                    f"{w.size}. Use a global batch size that is a multiple of the world size."
                )
            n = v.shape[0] // w.size
            out[k] = v[w.rank * n : (w.rank + 1) * n].to(w.device)
        return out

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # -- helpers --------------------------------------------------------------------------------
    def mesh(self, config: ShardConfig):
        from torch.distributed.device_mesh import init_device_mesh

        ensure_process_group(config.timeout, torch.cuda.is_available())
        if self._mesh is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            self._mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        return self._mesh

    def _device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward (non-reentrant ``torch.utils.checkpoint``).

    The forward is wrapped on the instance instead of swapping in a ``CheckpointWrapper``, so
    parameter names (and therefore state-dict keys and plan paths) stay exactly as they were.
    FSDP2's hooks sit on ``module.__call__`` and still run once per forward; the recomputation calls
    the original forward while the unit's parameters are already unsharded for backward.
    """
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    module._shardcore_checkpointed = True  # type: ignore[attr-defined]
