"""Deliberately wrong XLA variants (test fixtures, not shipped): the tests show that the conformance
suite catches each. Loaded as ``broken_xla_backends:<Class>`` with tests/ on the path."""

from __future__ import annotations

from shardcore_xla import SpmdBackend, XlaFsdpBackend


class NoLocalBatchScaling(SpmdBackend):
    """SPMD that feeds every device the first device's slice instead of sharding the global batch."""

    name = "xla-broken-batch"

    def local_batch(self, batch):
        import torch_xla.runtime as xr

        n = xr.global_runtime_device_count()
        first = {k: v[: v.shape[0] // n].repeat((n,) + (1,) * (v.dim() - 1)) for k, v in batch.items()}
        return super().local_batch(first)


class WithoutUnitFixes(XlaFsdpBackend):
    """XLA FSDP without shardcore's fixes for units that return several tensors: the torch_xla 2.9
    bugs then show (stale weights in forward; a crash under xla_fsdp_grad_ckpt)."""

    name = "xla-broken-no-unit-fixes"
    unit_fixes = False


class HSDPReplicasShareRows(SpmdBackend):
    """SPMD HSDP whose replicas all train on the first replica's rows: the batch split by shard
    only, as if each replica read its own copy of the data. (Annotating the real batch over the
    ``fsdp`` axis alone would not be this bug: under SPMD that only duplicates work, the program
    still sees every row.)"""

    name = "xla-broken-hsdp-rows"

    def local_batch(self, batch):
        replicas = dict(zip(self._mesh.axis_names, self._mesh.mesh_shape)).get("replicate", 1)
        first = {k: v[: v.shape[0] // replicas].repeat((replicas,) + (1,) * (v.dim() - 1)) for k, v in batch.items()}
        return super().local_batch(first)
