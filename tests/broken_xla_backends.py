"""Deliberately wrong XLA variants (test fixtures, not shipped): the tests show that the conformance
suite catches each. Loaded as ``broken_xla_backends:<Class>`` with tests/ on the path."""

from __future__ import annotations

import contextlib

from shardcore_xla import SpmdBackend, XlaFsdpBackend

from broken_backends import untrained_like


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


@contextlib.contextmanager
def _batch_spec(spec):
    """SPMD's batch annotation (inputs, and outputs through ``shard_output``) replaced by ``spec``."""
    from shardcore_xla import spmd

    saved = spmd.batch_spec
    spmd.batch_spec = spec
    try:
        yield
    finally:
        spmd.batch_spec = saved


class _BatchSpec(SpmdBackend):
    """SPMD with its own batch annotation, on inputs and forward outputs alike."""

    @staticmethod
    def spec(mesh, t):
        raise NotImplementedError

    def _wrap(self, model, plan, config):
        wrapped = super()._wrap(model, plan, config)
        for m in wrapped.modules():  # the root and every FSDPv2 unit annotate their outputs
            if getattr(m, "_shard_output", None) is not None:
                m._shard_output = self._annotated(m._shard_output)
        return wrapped

    def _annotated(self, shard_output):
        def annotated(output, mesh):
            with _batch_spec(self.spec):
                return shard_output(output, mesh)

        return annotated

    def local_batch(self, batch):
        with _batch_spec(self.spec):
            return super().local_batch(batch)


class ReplicatedBatch(_BatchSpec):
    """SPMD whose batch is replicated: every device computes the whole batch. The numbers are
    right; gradients need no sum across devices, and the run is data-parallel in name only."""

    name = "xla-broken-replicated-batch"

    @staticmethod
    def spec(mesh, t):
        return (None,) * t.dim()


class HSDPBatchOverShardsOnly(_BatchSpec):
    """SPMD HSDP whose batch is split over ``fsdp`` alone: every replica computes the same rows
    (the program still sees every row, so the numbers are right), and gradients never cross replicas."""

    name = "xla-broken-hsdp-shards-only"

    @staticmethod
    def spec(mesh, t):
        return ("fsdp",) + (None,) * (t.dim() - 1)


class ReplicatedParameters(SpmdBackend):
    """SPMD FSDPv2 whose parameters are annotated replicated before wrapping (FSDPv2 leaves an
    annotated parameter as it is): plain data parallelism, right numbers, no parameter sharded."""

    name = "xla-broken-replicated-parameters"

    def _wrap(self, model, plan, config):
        import torch_xla
        import torch_xla.distributed.spmd as xs

        from shardcore_xla import spmd

        mesh = spmd.mesh(self._mesh, spmd.shape(config)[0])
        model = spmd.to_device_keeping_ties(model, torch_xla.device())
        for p in model.parameters():
            xs.mark_sharding(p, mesh, (None,) * p.dim())
        return super()._wrap(model, plan, config)


def _without(config, **values):
    import dataclasses

    return dataclasses.replace(config, **values)


class _DropsOptimizerState:
    """Checkpoints that hold an untrained optimizer's state (``broken_backends.untrained_like``)."""

    def full_optimizer_state_dict(self, model, optimizer):
        return super().full_optimizer_state_dict(model, untrained_like(optimizer))

    def save_sharded_state_dict(self, model, optimizer, path):
        super().save_sharded_state_dict(model, untrained_like(optimizer), path)


class _IgnoresGradCkpt:
    """``xla_fsdp_grad_ckpt`` accepted and dropped: the same numbers and collectives, every activation kept."""

    def _wrap(self, model, plan, config):
        return super()._wrap(model, plan, _without(config, xla_fsdp_grad_ckpt=False))


class _IgnoresComputeDtype:
    """``xla_fsdp_settings: {compute_dtype: ...}`` accepted and dropped: the model computes in fp32."""

    def _wrap(self, model, plan, config):
        settings = {k: v for k, v in config.xla_fsdp_settings.items() if k != "compute_dtype"}
        return super()._wrap(model, plan, _without(config, xla_fsdp_settings=settings))


def _resolver(name, mixin):
    """The ``xla`` name with ``mixin`` in both of its implementations (XLA FSDP and SPMD)."""
    from shardcore_xla.backend import XLABackend

    fsdp = type(f"{mixin.__name__}Fsdp", (mixin, XlaFsdpBackend), {})
    spmd = type(f"{mixin.__name__}Spmd", (mixin, SpmdBackend), {})

    class Resolver(XLABackend):
        def __init__(self):
            self._by_v2 = {False: fsdp(), True: spmd()}

    Resolver.name = name
    Resolver.__doc__ = mixin.__doc__
    return Resolver


IgnoresGradCkpt = _resolver("xla-broken-ignores-grad-ckpt", _IgnoresGradCkpt)
DropsOptimizerState = _resolver("xla-broken-drops-optimizer-state", _DropsOptimizerState)
IgnoresComputeDtype = _resolver("xla-broken-ignores-compute-dtype", _IgnoresComputeDtype)


class IgnoresSpmd(XlaFsdpBackend):
    """``xla_fsdp_v2: true`` accepted and run as XLA FSDP: every device computes its own rows with the
    same numbers, and no SPMD program is ever built."""

    name = "xla-broken-ignores-v2"

    def validate(self, config):
        super().validate(_without(config, xla_fsdp_v2=False))

    def _wrap(self, model, plan, config):
        return super()._wrap(model, plan, _without(config, xla_fsdp_v2=False))


class _TensorParallelAs(SpmdBackend):
    """SPMD with tensor parallelism whose plan is replaced by :meth:`plan_for` (None: no split)."""

    def plan_for(self, model, plan, config):
        raise NotImplementedError

    def _wrap(self, model, plan, config):
        import dataclasses

        return super()._wrap(model, dataclasses.replace(plan, tp=self.plan_for(model, plan, config)), config)


class SpmdIgnoresTensorParallel(SpmdBackend):
    """SPMD that accepts ``tp_size`` and shards over every device as one data-parallel group: the
    same numbers (each device computes its own rows), no weight split over a tensor axis."""

    name = "xla-broken-ignores-tp"

    def _wrap(self, model, plan, config):
        import dataclasses

        return super()._wrap(model, dataclasses.replace(plan, tp=None), _without(config, tp_size=1, tp_plan=None))


class SpmdSplitsRowwiseColwise(_TensorParallelAs):
    """SPMD that marks rowwise weights as colwise ones (their output dim on ``tensor``): the same
    numbers (the partitioner makes any split compute right), the other dim of each weight split."""

    name = "xla-broken-rowwise-as-colwise"

    def plan_for(self, model, plan, config):
        import dataclasses

        styles = tuple((n, "colwise" if s.startswith("rowwise") else s) for n, s in plan.tp.styles)
        return dataclasses.replace(plan.tp, styles=styles)


class SpmdIgnoresTpPlan(_TensorParallelAs):
    """SPMD that accepts ``tp_plan`` and splits by the model's own plan: the same numbers, other
    weights split."""

    name = "xla-broken-ignores-tp-plan"

    def plan_for(self, model, plan, config):
        from shardcore.tp import build_tp_plan

        return build_tp_plan(model, _without(config, tp_plan=None))
