"""Deliberately wrong backends, shipped so the suite can show that it catches real bugs."""
from __future__ import annotations

from shardcore_fsdp2 import FSDP2Backend


class SumGradsBackend(FSDP2Backend):
    """FSDP2 that sums gradients across ranks instead of averaging them."""

    name = "broken-sum-grads"

    def apply(self, model, plan, config):
        from torch.distributed.fsdp import FSDPModule

        model = super().apply(model, plan, config)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return model


class WrongSliceBackend(FSDP2Backend):
    """FSDP2 whose ranks all train on the first slice of the batch (an off-by-one in slicing)."""

    name = "broken-wrong-slice"

    def local_batch(self, batch):
        n = self.world().size
        return {k: v[: v.shape[0] // n].to(self.world().device) for k, v in batch.items()}
