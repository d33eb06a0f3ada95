"""Deliberately wrong backends (test fixtures, not shipped): each must fail the conformance suite,
which shows that the suite catches the bug it has. Loaded as ``broken_backends:<Class>`` with tests/ on
the path (the tests put it there; from a checkout: ``PYTHONPATH=tests``)."""

from __future__ import annotations

import os

import torch

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


class LocalNormClippingBackend(FSDP2Backend):
    """FSDP2 that clips each rank's gradient shards by their own norm, what calling
    ``torch.nn.utils.clip_grad_norm_`` on the local shards does, instead of the global norm."""

    name = "broken-local-clip"

    def clip_grad_norm_(self, model, max_norm, norm_type):
        from torch.distributed.tensor import DTensor

        local = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in model.parameters()
            if p.grad is not None
        ]
        total = torch.nn.utils.get_total_norm(local, norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in local:
            g.mul_(coef)  # to_local() shares the shard's storage
        return total


class SkipsReplicaAllReduceBackend(FSDP2Backend):
    """HSDP whose replicas never all-reduce their gradients: each replica group trains on its own
    ranks' rows only, and the replicas drift apart."""

    name = "broken-no-replica-all-reduce"

    def apply(self, model, plan, config):
        from torch.distributed.fsdp import FSDPModule

        model = super().apply(model, plan, config)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_requires_all_reduce(False, recurse=False)
        return model


class AbortsOnRankOneBackend(FSDP2Backend):
    """A rank that native code aborts mid-run (what glibc does on a corrupted heap): it writes no
    error, and its peers fail with "connection closed". The report must name the aborted rank."""

    name = "broken-aborts"

    def apply(self, model, plan, config):
        import torch.distributed as dist

        model = super().apply(model, plan, config)
        if dist.get_rank() == 1:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file where the test runs
            os.abort()
        return model


class SlicesFromRowZeroBackend(FSDP2Backend):
    """Sliced loading that reads every rank's rows from the top of each tensor, what forgetting
    DTensor's global offset does: rank 1 gets rank 0's rows."""

    name = "broken-slice-offset"

    def load_full_slices(self, model, fill):
        def from_row_zero(name, index, out):
            fill(name, tuple(slice(0, s.stop - s.start) for s in index), out)

        super().load_full_slices(model, from_row_zero)


class StallsBackend(FSDP2Backend):
    """FSDP2 whose ranks stop making progress in the first step, as a deadlocked collective does
    (a sleep far past any case deadline): the suite must kill it and fail the case, not wait."""

    name = "broken-stalls"

    def local_batch(self, batch):
        import time

        time.sleep(3600)
        return super().local_batch(batch)


class WholeModelUnitBackend(FSDP2Backend):
    """FSDP2 that shards the whole model as one unit whatever the wrap plan says. The numbers are
    right (every parameter is gathered for the whole step); the communication is one all-gather per
    micro-batch instead of one per unit, and the memory of a fully gathered model."""

    name = "broken-whole-model-unit"

    def apply(self, model, plan, config):
        import dataclasses

        return super().apply(model, dataclasses.replace(plan, units=()), config)


class NoSyncStillReducesBackend(FSDP2Backend):
    """FSDP2 whose ``no_sync`` does nothing: every micro-batch's gradients are reduce-scattered and
    summed in the shards. The numbers are right; the gradient communication is multiplied by the
    number of micro-batches."""

    name = "broken-no-sync-reduces"

    def no_sync(self, model):
        import contextlib

        return contextlib.nullcontext()


def _without(config, **defaults):
    """``config`` with keys put back to these values: the key accepted, its effect dropped."""
    import dataclasses

    return dataclasses.replace(config, **defaults)


class IgnoresActivationCheckpointingBackend(FSDP2Backend):
    """FSDP2 that accepts ``activation_checkpointing`` and keeps every activation: the same numbers and
    collectives, none of the memory the key exists to save."""

    name = "broken-ignores-ac"

    def apply(self, model, plan, config):
        return super().apply(model, plan, _without(config, activation_checkpointing=False))


class IgnoresTimeoutBackend(FSDP2Backend):
    """FSDP2 that accepts ``timeout`` and leaves the process group's timeout at the default: a peer that
    stops is waited for 30 minutes instead of the configured time."""

    name = "broken-ignores-timeout"

    def validate_model(self, model, plan, config):
        super().validate_model(model, plan, _without(config, timeout=1800.0))

    def mesh(self, config):
        return super().mesh(_without(config, timeout=1800.0))


class IgnoresRank0WeightsBackend(FSDP2Backend):
    """FSDP2 that accepts ``cpu_ram_efficient_loading`` and shards each rank's own weights instead of
    rank 0's (the same as the key when every rank happens to hold the same weights)."""

    name = "broken-ignores-rank0-weights"

    def validate_model(self, model, plan, config):
        super().validate_model(model, plan, _without(config, cpu_ram_efficient_loading=False))

    def apply(self, model, plan, config):
        return super().apply(model, plan, _without(config, cpu_ram_efficient_loading=False))


class DropsOptimizerStateBackend(FSDP2Backend):
    """FSDP2 whose checkpoints hold the state of an optimizer that never stepped: the model is saved
    and loaded right, and a resumed run trains on with a fresh AdamW (no moments, step 0)."""

    name = "broken-drops-optimizer-state"

    def full_optimizer_state_dict(self, model, optimizer):
        return super().full_optimizer_state_dict(model, untrained_like(optimizer))

    def save_sharded_state_dict(self, model, optimizer, path):
        super().save_sharded_state_dict(model, untrained_like(optimizer), path)


def untrained_like(optimizer):
    """An optimizer over the same parameters with the same settings whose state is what one step of
    zero gradients at lr 0 leaves (moments zero, the parameters untouched): state of every entry a
    checkpoint expects, none of what training put there."""
    if optimizer is None:
        return None
    fresh = type(optimizer)([{**g, "lr": 0.0} for g in optimizer.param_groups])
    params = [p for g in fresh.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    fresh.step()
    for p in params:
        p.grad = None
    for mine, theirs in zip(fresh.param_groups, optimizer.param_groups):
        mine["lr"] = theirs["lr"]
    return fresh


class WritesAsyncSavesNowBackend(FSDP2Backend):
    """FSDP2 that accepts ``async_save`` and writes its SHARDED checkpoints before ``save()``
    returns (its background save is the synchronous one): the checkpoint is right, and the training
    loop waits for the whole write."""

    name = "broken-writes-async-saves-now"

    def async_save_sharded_state_dict(self, model, optimizer, path):
        self.save_sharded_state_dict(model, optimizer, path)
        return lambda: None


class IgnoresTensorParallelBackend(FSDP2Backend):
    """FSDP2 that accepts ``tp_size`` and shards every rank as one data-parallel group: the same
    numbers (every rank trains on its own rows), none of the split."""

    name = "broken-ignores-tp"

    def apply(self, model, plan, config):
        import dataclasses

        return super().apply(model, dataclasses.replace(plan, tp=None), _without(config, tp_size=1, tp_plan=None))


class SplitsRowwiseColwiseBackend(FSDP2Backend):
    """FSDP2 with tensor parallelism whose style table maps ``rowwise`` to a column split that first
    gathers its input and then its output: the same numbers, the other dim of each weight split,
    and an all-gather of the activations where a row split sums them."""

    name = "broken-rowwise-as-colwise"

    def apply(self, model, plan, config):
        import shardcore_fsdp2.tensor_parallel as tensor_parallel

        right = tensor_parallel.torch_style

        def wrong(style):
            if style == "rowwise":
                from torch.distributed.tensor import Replicate, Shard
                from torch.distributed.tensor.parallel import ColwiseParallel

                return ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
            return right(style)

        tensor_parallel.torch_style = wrong
        try:
            return super().apply(model, plan, config)
        finally:
            tensor_parallel.torch_style = right


class IgnoresTpPlanBackend(FSDP2Backend):
    """FSDP2 with tensor parallelism that accepts ``tp_plan`` and splits by the model's own plan:
    the same numbers, other weights split."""

    name = "broken-ignores-tp-plan"

    def apply(self, model, plan, config):
        import dataclasses

        from shardcore.tp import build_tp_plan

        own = build_tp_plan(model, _without(config, tp_plan=None))
        return super().apply(model, dataclasses.replace(plan, tp=own), config)
