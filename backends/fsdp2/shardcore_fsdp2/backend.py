"""FSDP2: ``fully_shard`` on each plan unit, then on the root, over a 1-D mesh of the whole world.

NCCL on CUDA, gloo on CPU. The shape follows torchtitan's ``parallelize_llama``: activation
checkpointing, then ``torch_compile`` (in place, :mod:`shardcore.compiling`), are applied to a unit
before it is sharded, and one set of ``fully_shard`` keyword arguments is used for every unit; the
root keeps its parameters gathered from forward to backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardcore import devices, safe_dcp
from shardcore.capabilities import (
    AsyncFullCheckpoints,
    AsyncShardedCheckpoints,
    ConfigValidation,
    GlobalGradSquares,
    GradClipping,
    GradSyncControl,
    ModelValidation,
    ShardedCheckpoints,
    SlicedLoading,
    TensorParallel,
)
from shardcore.compiling import compile_in_place, compile_targets
from shardcore.config import ShardConfig
from shardcore.distributed import TorchDistributedRuntime, ensure_process_group, slice_rows
from shardcore.empty import await_weights, materialize_empty, weights_state
from shardcore.plan import WrapPlan
from shardcore.ties import ties_kept
from shardcore.validate import check_rank0_weights, check_uniform_unit_dtypes, data_parallel_shape

from . import loading, snapshot, tensor_parallel

log = logging.getLogger(__name__)


class FSDP2Backend(
    TorchDistributedRuntime,
    ShardedCheckpoints,
    AsyncShardedCheckpoints,
    AsyncFullCheckpoints,
    GradClipping,
    GradSyncControl,
    ConfigValidation,
    ModelValidation,
    GlobalGradSquares,
    SlicedLoading,
    TensorParallel,
):
    """world/barrier/all_reduce_sum/broadcast_object/local_batch come from TorchDistributedRuntime."""

    name = "fsdp2"
    #: the conformance suite checks each step's collectives against FSDP's per-unit pattern
    communication_pattern = "fsdp"
    install_hint = "pip install 'torch>=2.9' && pip install -e backends/fsdp2"
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
            "state_dict_type",
            "async_save",
            "cpu_ram_efficient_loading",
            "dp_replicate_size",
            "dp_shard_size",
            "tp_size",
            "tp_plan",
            "torch_compile",
            "torch_compile_backend",
            "torch_compile_mode",
            "torch_compile_fullgraph",
            "torch_compile_dynamic",
            "torch_compile_regional",
            "use_cpu",
        }
    )

    def __init__(self) -> None:
        self._mesh = None
        self._mesh_group = None
        self._mesh_shape: tuple[int, int, int] | None = None
        self._root_mesh = None  # where tp_size > 1: (dp_replicate, dp_shard, tp), whose slices the others are
        self._checkpoint_group = None  # async saves' own gloo group, made at the first one
        self._staging = snapshot.Staging()  # their CPU copies, reused from one save to the next

    # -- protocol -------------------------------------------------------------------------------
    def is_available(self) -> tuple[bool, str]:
        ok, reason = super().is_available()
        if not ok:
            return ok, reason
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return (
                False,
                f"torch {torch.__version__} has no public torch.distributed.fsdp.fully_shard (shardcore needs >= 2.9)",
            )
        return ok, reason

    def apply(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = self.mesh(config)
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward}
        if config.mixed_precision is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(**config.mixed_precision.torch_dtypes())
        if config.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self._device().type != "cpu")
        # cpu_ram_efficient_loading: shard on the meta device, then fill the shards, either from the
        # checkpoint later (every rank built the model without weights) or from rank 0's weights now
        empty = config.cpu_ram_efficient_loading and self.broadcast_object(weights_state(model) == "empty")
        from_rank0 = (
            loading.take_rank0_weights(model)
            if config.cpu_ram_efficient_loading and not empty and dist.get_world_size() > 1
            else None
        )
        if plan.tp is not None:
            # torchtitan's order: split first, then shard the split tensors on the data-parallel dims
            # (fully_shard sees DTensors on the tp dim and makes them 2-D)
            tensor_parallel.apply(model, plan.tp, self._tp_mesh)
        compiled = compile_targets(model, plan, config)
        for unit in plan.modules(model):
            if config.activation_checkpointing:
                checkpoint_forward(unit)
            if any(unit is c for c in compiled):
                compile_in_place(unit, config)
            fully_shard(unit, **kwargs)
        if any(model is c for c in compiled):
            compile_in_place(model, config)
        # the root's parameters are the first the backward needs, so they are not freed after
        # forward only to be gathered again (FSDP1's FULL_SHARD and FSDP2's own default for the root)
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        if empty:
            materialize_empty(model, self._device())
            await_weights(model)
        elif from_rank0 is not None:
            self.load_full_state_dict(model, from_rank0[0])
            loading.broadcast_buffers(model, from_rank0[1], self._device())
        return model

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # rank 0's tensors are broadcast one at a time; each rank keeps its shard. A meta-device
        # model gets new tensors assigned, one per name, which unties tied weights: tie them again
        # to the parameter FSDP2 manages (the first holder, in module order).
        with ties_kept(model):
            set_model_state_dict(
                model, state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )

    def shards_without_weights(self, config: ShardConfig) -> bool:
        return True

    def load_full_slices(self, model: nn.Module, fill: Any) -> None:
        loading.fill_shards(model, fill)

    def read_optimizer_slices(self, model: nn.Module, osd: dict[str, Any], fill: Any) -> dict[str, Any]:
        return loading.read_optimizer_slices(model, osd, fill)

    def load_optimizer_slices(self, model: nn.Module, optimizer: torch.optim.Optimizer, part: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, part)

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_full_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            model, optimizer, osd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )

    def save_sharded_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(snapshot.state(model, optimizer), checkpoint_id=path)

    def async_save_sharded_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str
    ) -> Any:
        """DCP's ``async_save`` (torchtitan's ``async_mode="async"``): the state is copied to CPU
        memory before it returns, then written by a thread that meets the other ranks on a gloo
        group of its own, never on the training loop's. (DCP's cached staging copy would save the
        copy's allocation, but it pins memory, which needs CUDA.)"""
        import torch.distributed.checkpoint as dcp

        group, stager = self._background_group(), snapshot.Stager(self._staging)
        future = dcp.async_save(
            snapshot.state(model, optimizer), checkpoint_id=path, process_group=group, async_stager=stager
        )
        return future.result

    def snapshot_full_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        """Each rank copies its shards to CPU memory; the returned function gathers them to rank 0
        on the background group (``snapshot.py``)."""
        taken = snapshot.take(model, optimizer, self._staging)
        group, w = self._background_group(), self.world()
        return functools.partial(snapshot.gather, taken, group, w.rank, w.size)

    def _background_group(self) -> Any:
        """The gloo group background saves meet on (None without a process group): the training
        loop's collectives go on beside theirs. Made collectively, at the first save."""
        if not dist.is_initialized():
            return None
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group

    def load_sharded_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = snapshot.state(model, optimizer)
        # reshards (the saving run may have had another world size); runs no code from the files
        safe_dcp.load(state, path)
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])

    # -- training-loop capabilities ---------------------------------------------------------------
    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """torchtitan's recipe: the gradients are DTensors, so ``get_total_norm`` reduces each
        rank's shard norms to the global one (``full_tensor()``), then every rank scales its shards
        by the same factor. With tensor parallelism the gradients live on two meshes (split
        weights on (dp, tp), the others on dp): one norm per mesh, then combined, as the
        Trainer's ``_mixed_mesh_grad_norm`` does."""
        groups = tensor_parallel.by_mesh([p for p in model.parameters() if p.grad is not None])
        norms = [tensor_parallel.global_norm([p.grad for p in ps], norm_type) for ps in groups]
        total = tensor_parallel.combine_norms(norms, norm_type)
        for ps in groups:
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
        return total

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Backward inside accumulates unsharded, unreduced gradients; the first backward after it
        reduce-scatters them once (FSDP2's ``set_requires_gradient_sync``)."""
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def validate(self, config: ShardConfig) -> None:
        """Combinations this torch release trains wrong, from the config alone."""
        tensor_parallel.check_compiled_tp(config)

    def validate_model(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> None:
        """cpu_ram_efficient_loading: rank 0 holds the weights and every rank's model matches it,
        checked with collectives before sharding, one verdict on every rank."""
        ensure_process_group(config.timeout, devices.requested(config.use_cpu), "timeout" in config.non_default_keys())
        data_parallel_shape(config, dist.get_world_size())
        check_uniform_unit_dtypes(model, plan)
        if config.cpu_ram_efficient_loading:
            check_rank0_weights(
                model, dist.get_rank(), self.broadcast_object, self.all_gather_object, weights_later=True
            )

    # -- helpers --------------------------------------------------------------------------------
    def mesh(self, config: ShardConfig):
        """The device mesh ``fully_shard`` gets: 1-D ``("fsdp",)`` over every rank, or under HSDP
        (``dp_replicate_size`` > 1) 2-D ``("dp_replicate", "dp_shard")``: parameters sharded within
        each replica group of ``dp_shard_size`` ranks, gradients all-reduced across the replicas.
        With ``tp_size`` > 1 both are slices of one root mesh ``("dp_replicate", "dp_shard", "tp")``
        whose innermost dim (neighbouring ranks) is tensor parallelism's (:attr:`_tp_mesh`)."""
        from torch.distributed.device_mesh import init_device_mesh

        ensure_process_group(config.timeout, devices.requested(config.use_cpu), "timeout" in config.non_default_keys())
        shape = (*data_parallel_shape(config, dist.get_world_size()), config.tp_size)
        device_type = devices.chosen()
        # a script may destroy the process group and start another (another size), or shard one model
        # on the accelerator and the next with use_cpu (gloo serves CPU tensors in the same group): the
        # mesh follows, since fully_shard moves parameters to the mesh's device type
        if (
            self._mesh is None
            or self._mesh_group is not dist.group.WORLD
            or self._mesh_shape != shape
            or self._mesh.device_type != device_type
        ):
            self._mesh_group, self._mesh_shape = dist.group.WORLD, shape
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            # the mesh is the ranks' layout, never data: built with real tensors also when the model
            # is sharded under FakeTensorMode (shardcore plan), where its rank list cannot be read
            with unset_fake_temporarily():
                replicas, shards, tp = shape
                self._root_mesh = None
                if tp > 1:
                    root = init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
                    self._root_mesh = root
                    self._mesh = root["dp_shard"] if replicas == 1 else root["dp_replicate", "dp_shard"]
                elif replicas == 1:
                    self._mesh = init_device_mesh(device_type, (shards,), mesh_dim_names=("fsdp",))
                else:
                    self._mesh = init_device_mesh(device_type, shape[:2], mesh_dim_names=("dp_replicate", "dp_shard"))
        return self._mesh

    def root_mesh(self, config: ShardConfig):
        self.mesh(config)
        return self._root_mesh

    @property
    def _tp_mesh(self):
        """The root mesh's innermost dim: tensor parallelism's groups (None without it)."""
        return self._root_mesh["tp"] if self._root_mesh is not None else None

    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This data-parallel group's contiguous slice of a global batch: with tensor parallelism
        every rank of one tp group (neighbouring ranks, the mesh's innermost dim) gets the same rows."""
        if self._tp_mesh is None:
            return super().local_batch(batch)
        w = self.world()
        tp = self._tp_mesh.size()
        return slice_rows(batch, w.rank // tp, w.size // tp, w.device, "data-parallel groups")

    def grad_sq_sum(self, model: nn.Module) -> torch.Tensor:
        """Sum of squared gradient entries of the whole model: each rank's shards, summed within its
        replica group only (under HSDP every replica holds the same shards). With tensor
        parallelism, through DTensor, which knows which ranks hold copies of a shard."""
        if self._tp_mesh is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            return tensor_parallel.global_sq_sum(grads, self._device())
        local = torch.zeros((), device=self._device())
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                local = local + g.detach().float().pow(2).sum().to(local.device)
        mesh = self._mesh
        group = mesh.get_group("dp_shard") if mesh is not None and mesh.ndim == 2 else None
        dist.all_reduce(local, group=group)
        return local


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
