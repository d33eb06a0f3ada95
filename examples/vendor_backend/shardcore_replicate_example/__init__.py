"""``replicate-example``: a shardcore backend that replicates the model and averages gradients.

Not a sharding backend (every rank holds everything), but a correct data-parallel one, which is
what the conformance suite checks: the same numbers as training on one device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardcore import devices
from shardcore.capabilities import GlobalGradSquares, GradClipping
from shardcore.config import ShardConfig
from shardcore.distributed import TorchDistributedRuntime, ensure_process_group
from shardcore.errors import CheckpointError
from shardcore.plan import WrapPlan

__all__ = ["ReplicateBackend"]


class ReplicateBackend(TorchDistributedRuntime, GradClipping, GlobalGradSquares):
    """world, barrier, all_reduce_sum, broadcast_object and local_batch (each rank its slice of the
    global batch) come from shardcore's TorchDistributedRuntime."""

    name = "replicate-example"
    install_hint = "pip install -e examples/vendor_backend"
    supported_keys = frozenset({"timeout"})

    def apply(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        # the plan says which modules would be units; replication needs none of them
        ensure_process_group(config.timeout, devices.requested(), "timeout" in config.non_default_keys())
        model.to(self._device())
        size = dist.get_world_size()
        with torch.no_grad():
            # every rank starts from rank 0's weights and buffers, whatever seed it used
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        if size > 1:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(_average_grad)
        return model

    # -- optional capability: shardcore.clip_grad_norm_ (shardcore.capabilities.GradClipping) -----
    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Every rank holds the whole averaged gradient, so torch's own clipping is already global.
        (A sharding backend must reduce the norm over ranks; the suite's clip-* cases check that.)"""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    # -- optional capability for the conformance suite (GlobalGradSquares) ----------------------
    def grad_sq_sum(self, model: nn.Module) -> torch.Tensor:
        """Sum of squared gradient entries of the whole model. Every rank holds all of it (already
        averaged), so no reduction: summing over ranks would count each entry world-size times."""
        total = torch.zeros((), device=self._device())
        for p in model.parameters():
            if p.grad is not None:
                total = total + p.grad.detach().float().pow(2).sum()
        return total

    # -- state dicts: the model is whole on every rank ----------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        """Rank 0 copies ``state_dict`` in, then every tensor is broadcast from rank 0."""
        targets = model.state_dict(keep_vars=True)
        problem = None
        if self.world().rank == 0:
            # tied weights appear under several names; one of them is enough
            loaded = {id(targets[k]) for k in state_dict if k in targets}
            missing = [k for k, t in targets.items() if id(t) not in loaded]
            unexpected = [k for k in state_dict if k not in targets]
            if missing or unexpected:
                problem = f"state dict does not fit {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        problem = self.broadcast_object(problem)  # every rank raises, none waits in a broadcast below
        if problem:
            raise CheckpointError(f"shardcore.load: {problem}. Load a checkpoint of this model.")
        with torch.no_grad():
            for k, t in targets.items():
                if k in state_dict:
                    t.copy_(state_dict[k])
                if dist.is_initialized():
                    dist.broadcast(t.data, src=0)

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_full_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        osd = self.broadcast_object(osd)
        set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))


def _average_grad(p: torch.Tensor) -> None:
    """After backward accumulated into ``p.grad``: replace it by its mean over the ranks. With
    gradient accumulation the part accumulated earlier is already equal on every rank, so averaging
    the sum again leaves it unchanged and averages only the new micro-batch's contribution."""
    dist.all_reduce(p.grad)
    p.grad.div_(dist.get_world_size())
