"""XLA backend: what ``TrainingArguments(fsdp_config={"xla": True, ...})`` does, driven by a WrapPlan.

* ``xla_fsdp_v2: false`` (default): ``XlaFullyShardedDataParallel`` on every plan unit, then on the
  root, with ``xla_fsdp_settings`` as its keyword arguments (``compute_dtype``/``buffer_dtype`` names
  become torch dtypes, as the Trainer converts them). One device per process or thread
  (``xmp.spawn`` / ``torch_xla.launch``).
* ``xla_fsdp_v2: true``: SPMD ``SpmdFullyShardedDataParallel`` over a mesh of every device with axes
  ``("fsdp", "model")``; one process drives all devices, inputs are sharded along the batch on the
  ``fsdp`` axis, and Hugging Face outputs are sharded the way the Trainer's ``shard_output`` does.
* ``xla_fsdp_grad_ckpt: true``: torch_xla's ``checkpoint_module`` on each unit before wrapping.

The wrapping decision is the plan's: torch_xla's own auto-wrap machinery is handed a policy that says
yes exactly to the plan's unit modules.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import math
import os
from typing import Any, Callable

import torch
from torch import nn

from shardcore.backend import World
from shardcore.capabilities import (
    CompileCounter,
    ConfigValidation,
    DeviceLaunch,
    GradClipping,
    GradSyncControl,
    Launcher,
    LaunchSpec,
    RenamesParameters,
    ShardedCheckpoints,
    StepEnd,
)
from shardcore.config import ShardConfig, dtype_name, show_value
from shardcore.errors import CheckpointError, DistributedSetupError, ShardConfigError, ShardcoreError, UnknownKeyError
from shardcore.plan import WrapPlan

from . import cpu, sharded, unit_fix

log = logging.getLogger(__name__)

# Set by shardcore from the plan, never by the user: accepting them would let a setting re-decide
# the wrapping behind the plan's back.
_PLAN_OWNED = {"auto_wrap_policy", "auto_wrapper_callable"}
# Callables cannot come from a JSON/YAML config.
_NOT_FROM_CONFIG = {"param_init_fn"}
_DTYPE_SETTINGS = {"compute_dtype", "buffer_dtype"}


class XLABackend(
    ShardedCheckpoints,
    StepEnd,
    GradClipping,
    GradSyncControl,
    Launcher,
    DeviceLaunch,
    ConfigValidation,
    CompileCounter,
    RenamesParameters,
):
    name = "xla"
    install_hint = "pip install torch==2.9.0 torch_xla==2.9.0 && pip install -e backends/xla"
    supported_keys = frozenset(
        {
            "auto_wrap_policy",
            "transformer_layer_cls_to_wrap",
            "min_num_params",
            "reshard_after_forward",
            "state_dict_type",
            "cpu_ram_efficient_loading",
            "xla",
            "xla_fsdp_v2",
            "xla_fsdp_settings",
            "xla_fsdp_grad_ckpt",
        }
    )

    #: shardcore's fixes for XLA FSDP units that return several tensors (unit_fix.py)
    unit_fixes = True

    def __init__(self) -> None:
        self._spmd: bool | None = None
        self._mesh = None
        # XLA FSDP on several CPU devices: the device threads of this process (see cpu.py)
        self._threads: cpu.DeviceThreads | None = None

    # -- protocol -------------------------------------------------------------------------------
    def is_available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("torch_xla") is None:
            return False, "torch_xla is not installed"
        return True, f"torch_xla (PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'auto')})"

    def apply(self, model: nn.Module, plan: WrapPlan, config: ShardConfig) -> nn.Module:
        spmd = config.xla_fsdp_v2
        from shardcore.checkpoint import tied_names

        # tied names, decided on the unwrapped model (the wrappers rename and deduplicate)
        aliases = tied_names(model)
        if spmd:
            kwargs = spmd_kwargs(config)
            self._spmd = True
            out = self._apply_spmd(model, plan, config, kwargs)
        else:
            kwargs = fsdp_kwargs(config)
            self._spmd = False
            self._threads = _device_threads(config)
            out = self._apply_fsdp(model, plan, config, kwargs)
        object.__setattr__(out, "_shardcore_tied_aliases", aliases)
        return out

    def tied_aliases(self, model: nn.Module) -> dict[str, str]:
        """``{tied name not stored in a FULL checkpoint: the name that is}``, in unwrapped names."""
        return dict(getattr(model, "_shardcore_tied_aliases", {}))

    def _with_aliases(self, model: nn.Module, d: dict[str, Any], copy: Callable[[Any], Any]) -> dict[str, Any]:
        # either name of a tied pair may be the one the wrapper kept
        for alias, kept in self.tied_aliases(model).items():
            if kept in d and alias not in d:
                d[alias] = copy(d[kept])
            elif alias in d and kept not in d:
                d[kept] = copy(d[alias])
        return d

    def world(self) -> World:
        import torch_xla
        import torch_xla.runtime as xr

        if self._spmd:
            # one controller drives every device: a single rank whose values are already global
            return World(0, 1, torch_xla.device())
        return World(xr.global_ordinal(), xr.world_size(), torch_xla.device())

    def barrier(self) -> None:
        import torch_xla.core.xla_model as xm

        if self._threads is not None:
            self._threads.wait()
        elif not self._spmd:
            xm.rendezvous("shardcore.barrier")

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks. Under SPMD a value is already global, so this is the identity."""
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self._spmd or xr.world_size() == 1:
            return tensor
        if self._threads is not None:
            parts = self._threads.gather_cpu(xr.global_ordinal(), tensor)
            return torch.stack(parts).sum(0).to(tensor.device)
        return xm.all_reduce(xm.REDUCE_SUM, tensor)

    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank feeds its model from a global batch: its slice (XLA FSDP), or the whole
        batch sharded along dim 0 on the mesh's ``fsdp`` axis (SPMD)."""
        import torch_xla
        import torch_xla.runtime as xr

        w = self.world()
        parts = xr.global_runtime_device_count() if self._spmd else w.size
        out = {}
        for k, v in batch.items():
            if v.shape[0] % parts:
                raise ShardcoreError(
                    f"shardcore xla: batch field {k!r} has {v.shape[0]} rows, not divisible by {parts} "
                    "devices. Use a global batch size that is a multiple of the device count."
                )
            if self._spmd:
                import torch_xla.distributed.spmd as xs

                t = v.to(torch_xla.device())
                xs.mark_sharding(t, self._mesh, ("fsdp",) + (None,) * (t.dim() - 1))
            else:
                n = v.shape[0] // w.size
                t = v[w.rank * n : (w.rank + 1) * n].to(torch_xla.device())
            out[k] = t
        return out

    def step_end(self) -> None:
        """Cut and run the step's lazy graph (``torch_xla.sync()``); call it after ``optimizer.step()``.

        On several CPU devices the device threads take turns, so that all run one compiled module."""
        import torch_xla

        if self._threads is not None:
            self._threads.sync()
        else:
            torch_xla.sync()

    def compile_count(self) -> int:
        """XLA compilations so far in this process (torch_xla's ``UncachedCompile`` counter)."""
        import torch_xla.debug.metrics as met

        return int(met.counter_value("UncachedCompile") or 0)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """One unsharded state dict with the original parameter names, on CPU (every rank gets it).

        The same format the FSDP2 backend writes, so a checkpoint moves between backends."""
        if self._spmd:
            sd = model.state_dict()
            # SPMD tensors are logically global: .cpu() gathers them
            full = {_strip_wrappers(k): v.detach().cpu().clone() for k, v in sd.items()}
        else:
            full = _consolidate_fsdp(model, self._threads)
        # a tied weight appears under each of its names, as in the unwrapped model's state_dict()
        return self._with_aliases(model, full, lambda t: t.clone())

    # -- checkpoints: the same FULL format as every backend (one unsharded state dict, original names)
    def broadcast_object(self, obj: Any) -> Any:
        import pickle

        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self._spmd or xr.world_size() == 1:
            return obj
        if self._threads is not None:
            return self._threads.exchange(xr.global_ordinal(), obj)[0]
        payload = pickle.dumps(obj) if xr.global_ordinal() == 0 else b""
        return pickle.loads(xm.rendezvous("shardcore.broadcast_object", payload)[0])

    def full_state_dict_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """The keys and shapes :meth:`full_state_dict` returns, without gathering anything."""
        shapes = {n: sh for pieces in _param_layout(model).values() for n, sh in pieces}
        shapes.update({k: tuple(b.shape) for k, b in _persistent_buffers(model).items()})
        return self._with_aliases(model, shapes, lambda s: s)

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        """Put an unsharded state dict (read on rank 0 only) into the sharded model, each rank taking
        its shard the way the wrapper laid it out."""
        sd = self._broadcast_tensors(state_dict)
        layout = _param_layout(model)
        missing = [n for p in model.parameters() for n, _ in layout[id(p)] if n not in sd]
        if missing:
            raise ShardcoreError(
                f"shardcore.load: the state dict lacks {missing[:5]} (and {max(0, len(missing) - 5)} more)."
            )
        with torch.no_grad():
            for p in model.parameters():
                flat = torch.cat([sd[n].detach().reshape(-1).to(p.dtype) for n, _ in layout[id(p)]])
                if self._spmd:
                    p.data = self._reshard(p, flat)  # a fresh tensor carrying the sharding annotation
                else:
                    p.copy_(self._reshard(p, flat))
            for bname, b in model.named_buffers():
                key = _strip_wrappers(bname)
                if key in sd:
                    b.copy_(sd[key].to(b.device, b.dtype))
        self.step_end()

    def full_optimizer_state_dict(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s state unsharded and keyed by parameter name (the layout of
        ``get_optimizer_state_dict(full_state_dict=True)``), on CPU."""
        layout = _param_layout(model)
        state: dict[str, Any] = {}
        for p, st in optimizer.state.items():
            pieces = layout[id(p)]
            per_piece: list[dict[str, Any]] = [{} for _ in pieces]
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    for d, t in zip(per_piece, self._unshard(p, v, pieces)):
                        d[k] = t
                else:
                    for d in per_piece:
                        d[k] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for (name, _), d in zip(pieces, per_piece):
                state[name] = d
        return {
            "state": state,
            "param_groups": sharded.named_param_groups(optimizer, lambda p: [n for n, _ in layout[id(p)]]),
        }

    def load_full_optimizer_state_dict(self, model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
        state = self.broadcast_object(state)
        layout = _param_layout(model)
        saved_state = state.get("state", {})
        sharded.restore_param_groups(optimizer, state.get("param_groups", []), "the checkpoint")
        new_state: dict[Any, dict[str, Any]] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                pieces = layout[id(p)]
                if pieces[0][0] not in saved_state:
                    continue
                first = saved_state[pieces[0][0]]
                st = {}
                for k, v in first.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        flat = torch.cat([saved_state[n][k].reshape(-1) for n, _ in pieces])
                        st[k] = self._reshard(p, flat)
                    else:
                        st[k] = v.clone() if isinstance(v, torch.Tensor) else v
                new_state[p] = st
        optimizer.state.clear()
        optimizer.state.update(new_state)
        self.step_end()

    def save_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        """SPMD: torch.distributed.checkpoint with torch_xla's SPMD planners. XLA FSDP: each rank
        writes its shards, rank 0 the shard index (see sharded.py). Collective."""
        self.step_end()  # the values to write exist only once the pending graph has run
        if self._spmd:
            sharded.save_spmd(model, optimizer, path, _strip_wrappers)
            return
        w = self.world()
        sharded.save_fsdp(model, optimizer, path, w.rank, w.size, _param_layout(model), _persistent_buffers(model))
        self.barrier()  # rank 0 commits the directory after this returns: every shard must be there

    def load_sharded_state_dict(self, model: nn.Module, optimizer: Any, path: str) -> None:
        """Read a checkpoint of :meth:`save_sharded_state_dict` from a run of any device count. Collective."""
        if self._spmd:
            if not os.path.isfile(os.path.join(path, ".metadata")):
                raise CheckpointError(
                    f"shardcore.load: {path!r} is not a torch.distributed.checkpoint directory, so not a sharded checkpoint "
                    "of SPMD (xla_fsdp_v2: true). A sharded checkpoint loads only into the XLA mode that wrote it; save "
                    "FULL_STATE_DICT to move between modes."
                )
            sharded.load_spmd(model, optimizer, path, _strip_wrappers)
            self.step_end()
            return
        if os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(
                f"shardcore.load: {path!r} is a torch.distributed.checkpoint directory (FSDP2 or SPMD), not XLA FSDP's "
                "per-rank shards. A sharded checkpoint loads only into the backend and mode that wrote it; save "
                "FULL_STATE_DICT to move between them."
            )
        rank0 = self.world().rank == 0
        full, osd = sharded.read_fsdp(path) if rank0 else ({}, None)
        self.load_full_state_dict(model, full)
        if optimizer is not None:
            self.load_full_optimizer_state_dict(model, optimizer, osd or {})

    def _unshard(
        self, p: torch.Tensor, v: torch.Tensor, pieces: list[tuple[str, tuple[int, ...]]]
    ) -> list[torch.Tensor]:
        """A tensor laid out like parameter ``p`` (its optimizer state) as unsharded CPU pieces."""
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self._threads is not None:
            v = torch.cat(self._threads.gather_cpu(xr.global_ordinal(), v))
        elif not self._spmd and xr.world_size() > 1:
            v = xm.all_gather(v.detach(), dim=0)
        flat = v.detach().cpu().reshape(-1)
        out, at = [], 0
        for _, shape in pieces:
            n = math.prod(shape)
            out.append(flat[at : at + n].view(shape).clone())
            at += n
        return out

    def _reshard(self, p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_unshard`: CPU values laid out like parameter ``p``, on its device."""
        import torch_xla.runtime as xr

        if self._spmd:
            return _like_spmd_param(p, flat.view(p.shape))
        return _fsdp_shard(flat, p, xr.global_ordinal(), xr.world_size()).to(p.device, flat.dtype)

    def _broadcast_tensors(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self._spmd or xr.world_size() == 1:
            return state_dict
        if self._threads is not None:
            return self._threads.exchange(xr.global_ordinal(), state_dict)[0]  # read-only on the others
        meta = self.broadcast_object({k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()})
        out = {}
        for k, (shape, dtype) in meta.items():
            t = state_dict[k] if k in state_dict else torch.zeros(shape, dtype=dtype)
            # only rank 0 contributes non-zeros, so a sum is a broadcast
            out[k] = xm.all_reduce(xm.REDUCE_SUM, t.to(self.world().device)).cpu()
        return out

    # -- launching (used by shardcore-conformance and available to scripts) ----------------------
    def launch_spec(self, config: ShardConfig, world_size: int):
        env = {}
        device = os.environ.get("PJRT_DEVICE", "CPU" if not _has_tpu() else "TPU")
        env["PJRT_DEVICE"] = device
        if device == "CPU":
            env["CPU_NUM_DEVICES"] = str(world_size)
        if config.xla_fsdp_v2:
            return LaunchSpec(processes=1, env=env, group="spmd")
        if device == "CPU" and world_size > 1:
            env.update(cpu.recipe_env(world_size))
        return LaunchSpec(processes=1, env=env, group="fsdp", per_device=world_size > 1)

    def validate(self, config: ShardConfig) -> None:
        """Raise ShardConfigError for settings or a combination of keys this backend refuses, from
        the config alone (no devices): ``shard()`` calls it before :meth:`apply`."""
        if self._spmd is not None and self._spmd != config.xla_fsdp_v2:
            raise ShardConfigError(
                "xla_fsdp_v2",
                f"is {config.xla_fsdp_v2} but this process already sharded a model with xla_fsdp_v2={self._spmd}; SPMD "
                "mode is global to a process. Use one mode per process.",
            )
        if config.xla_fsdp_v2:
            spmd_kwargs(config)
        else:
            fsdp_kwargs(config)

    def run_on_devices(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(ordinal)`` once per device (``xmp.spawn``). On CPU it first sets the runtime
        environment XLA FSDP needs on several devices (see cpu.py), which the spawned process inherits."""
        import torch_xla.distributed.xla_multiprocessing as xmp

        if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
            cpu.prepare(int(os.environ.get("CPU_NUM_DEVICES", "1")))
        xmp.spawn(_call_with_ordinal, args=(fn,))

    def launch(self, fn: Callable[[], None], config: ShardConfig) -> None:
        """``fn()`` once per local device under XLA FSDP (``xmp.spawn``), once under SPMD."""
        if config.xla_fsdp_v2:
            fn()
        else:
            self.run_on_devices(functools.partial(_without_ordinal, fn))

    # -- training-loop capabilities ---------------------------------------------------------------
    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """SPMD parameters are global, so torch's own function is right. Under XLA FSDP each rank
        holds flat shards of every gradient; see :func:`_clip_fsdp_grads`."""
        if self._spmd:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return _clip_fsdp_grads(model, max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> Any:
        """XLA FSDP: accumulate full gradients without reduce-scatter (XlaFullyShardedDataParallel's
        ``no_sync``). SPMD: nothing to do, the compiler places the reductions."""
        if self._spmd:
            return contextlib.nullcontext()
        return model.no_sync()

    # -- the two modes ----------------------------------------------------------------------------
    def _apply_fsdp(self, model: nn.Module, plan: WrapPlan, config: ShardConfig, kwargs: dict[str, Any]) -> nn.Module:
        import torch_xla

        if self._threads is not None:
            kwargs = cpu_fsdp_kwargs(config, kwargs)  # after _device_threads() checked the runtime
        if self.unit_fixes:
            fsdp = unit_fix.fsdp_class()
        else:
            from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as fsdp
        # cpu_ram_efficient_loading: the other ranks may hold meta tensors; rank 0's weights fill the
        # shards after wrapping
        from_rank0 = (
            self._take_rank0_weights(model) if config.cpu_ram_efficient_loading and self.world().size > 1 else None
        )
        if from_rank0 is None and self._threads is not None:
            _start_from_device0(model, self._threads)
        out = fsdp(
            _to_device_keeping_ties(model, torch_xla.device()),
            auto_wrap_policy=_plan_policy(model, plan),
            auto_wrapper_callable=_unit_wrapper(fsdp, config.xla_fsdp_grad_ckpt, self.unit_fixes),
            **kwargs,
        )
        if from_rank0 is not None:
            self.load_full_state_dict(out, from_rank0)  # non-persistent buffers (rotary inv_freq) included
        return out

    def _take_rank0_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Rank 0's parameters and buffers (every buffer: the other ranks' meta ones have no value), by
        name; ``{}`` on the other ranks. Every rank reaches the same verdict on a bad model."""
        rank = self.world().rank
        tensors = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        layout = {k: tuple(t.shape) for k, t in tensors.items()}
        rank0_meta, rank0_layout = self.broadcast_object((any(t.is_meta for t in tensors.values()), layout))
        problem = None
        if rank0_meta:
            problem = (
                "is true but rank 0's model has tensors on the meta device. Rank 0 must hold the real weights "
                "(from_pretrained there); the other ranks may build the model on the meta device."
            )
        elif layout != rank0_layout:
            diff = sorted(set(layout.items()) ^ set(rank0_layout.items()))[:3]
            problem = f"is true but rank {rank}'s model differs from rank 0's (names or shapes: {diff}). Build the same model on every rank."
        bad = next((p for p in self._all_gather_object(problem) if p), None)
        if bad:
            raise ShardConfigError("cpu_ram_efficient_loading", bad)
        return {_strip_wrappers(k): t.detach() for k, t in tensors.items()} if rank == 0 else {}

    def _all_gather_object(self, obj: Any) -> list[Any]:
        import pickle

        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if self._spmd or xr.world_size() == 1:
            return [obj]
        if self._threads is not None:
            return self._threads.exchange(xr.global_ordinal(), obj)
        return [pickle.loads(b) for b in xm.rendezvous("shardcore.all_gather_object", pickle.dumps(obj))]

    def _apply_spmd(self, model: nn.Module, plan: WrapPlan, config: ShardConfig, kwargs: dict[str, Any]) -> nn.Module:
        import numpy as np
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

        if config.cpu_ram_efficient_loading and any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            raise ShardConfigError(
                "cpu_ram_efficient_loading",
                "is true, but under SPMD (xla_fsdp_v2: true) one process drives every device, so it is rank 0 and "
                "must hold the real weights; this model has tensors on the meta device. Load the weights in it.",
            )
        if not xr.is_spmd():
            xr.use_spmd()
        if self._mesh is None:
            n = xr.global_runtime_device_count()
            self._mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
            xs.set_global_mesh(self._mesh)

        return FSDPv2(
            _to_device_keeping_ties(model, torch_xla.device()),
            mesh=self._mesh,
            shard_output=shard_output,
            auto_wrap_policy=_plan_policy(model, plan),
            auto_wrapper_callable=_unit_wrapper(FSDPv2, config.xla_fsdp_grad_ckpt, fixes=False),
            **kwargs,
        )


def _device_threads(config: ShardConfig) -> cpu.DeviceThreads | None:
    """The device-thread group when XLA FSDP runs on several CPU devices (None elsewhere: one device,
    or TPU with one device per process), after checking the runtime has the CPU recipe."""
    import torch_xla.runtime as xr

    if os.environ.get("PJRT_DEVICE") == "CPU":
        cpu.prepare(int(os.environ.get("CPU_NUM_DEVICES", "1")))  # only takes effect before the runtime starts
    n = xr.world_size()
    if xr.device_type() != "CPU" or n == 1:
        return None
    cpu.check(n)
    cpu.thread_local_checkpoint_status()
    return cpu.device_threads(n, config.timeout)


def _clip_fsdp_grads(model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
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


def _start_from_device0(model: nn.Module, threads: cpu.DeviceThreads) -> None:
    """Give every device thread device 0's initial weights (FSDP1's ``sync_module_states``). The
    threads share one process and so one global RNG: seeding and building the model in each of
    them interleaves their draws, and identical seeds do not give identical weights."""
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    src = threads.exchange(rank, mine)[0]
    problem = None
    if rank != 0:
        with torch.no_grad():
            for k, t in mine.items():
                s = src.get(k)
                if s is None or s.shape != t.shape or t.is_meta:
                    got = "missing" if s is None else tuple(s.shape)
                    problem = (
                        f"shardcore xla: device {rank}'s model differs from device 0's at {k!r} (shape "
                        f"{tuple(t.shape)}{', on the meta device' if t.is_meta else ''}; device 0: {got}). Build "
                        "the same model with real weights on every device (for meta-device models, set "
                        "cpu_ram_efficient_loading)."
                    )
                    break
                t.copy_(s)
    bad = next((p for p in threads.exchange(rank, problem) if p), None)  # device 0 waits for the copies
    if bad:
        raise DistributedSetupError(bad)


def cpu_fsdp_kwargs(config: ShardConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for XLA FSDP on several CPU devices: unpinned collective layouts (a pinned
    all_gather traces a different graph per device), and no sync inside backward (only the
    serialized step end may sync)."""
    for name, needed in (("pin_layout_in_collective_ops", False), ("sync_on_finalization", False)):
        if name in config.xla_fsdp_settings and config.xla_fsdp_settings[name] != needed:
            raise ShardConfigError(
                f"xla_fsdp_settings.{name}",
                f"is {config.xla_fsdp_settings[name]!r}, but XLA FSDP on several CPU PJRT devices needs {needed} "
                "(torch_xla 2.9's CPU collectives meet only when every device thread runs the same compiled module; "
                f"see the README's XLA section). Remove {name} or run on one CPU device or a TPU.",
            )
    return {**kwargs, "pin_layout_in_collective_ops": False}


def _unit_wrapper(wrapper_cls: type, grad_ckpt: bool, fixes: bool) -> Callable[..., nn.Module]:
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


# ---------------------------------------------------------------- settings


def _fsdp_parameters() -> dict[str, inspect.Parameter]:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    params = inspect.signature(FSDP.__init__).parameters
    return {n: p for n, p in params.items() if n not in ("self", "module") and not n.startswith("_")}


def fsdp_kwargs(config: ShardConfig) -> dict[str, Any]:
    """``xla_fsdp_settings`` checked against ``XlaFullyShardedDataParallel``'s arguments and
    converted as the Trainer converts them."""
    valid = _fsdp_parameters()
    settable = {n: p for n, p in valid.items() if n not in _PLAN_OWNED | _NOT_FROM_CONFIG}
    out: dict[str, Any] = {}
    for name, value in config.xla_fsdp_settings.items():
        key = f"xla_fsdp_settings.{name}"
        if name in _PLAN_OWNED:
            raise ShardConfigError(
                key,
                "is decided by shardcore's wrap plan. Use auto_wrap_policy / transformer_layer_cls_to_wrap / min_num_params.",
            )
        if name in _NOT_FROM_CONFIG:
            raise ShardConfigError(key, "takes a Python callable, which a config cannot hold. Remove it.")
        if name not in settable:
            raise UnknownKeyError(
                key, [f"xla_fsdp_settings.{n}" for n in settable], where="XlaFullyShardedDataParallel arguments"
            )
        out[name] = _convert(key, value, settable[name].default)
    if (
        "reshard_after_forward" in out
        and "reshard_after_forward" in config.explicit
        and out["reshard_after_forward"] != config.reshard_after_forward
    ):
        raise ShardConfigError(
            "xla_fsdp_settings.reshard_after_forward",
            f"is {out['reshard_after_forward']} but reshard_after_forward is {config.reshard_after_forward}. Keep one.",
        )
    out.setdefault("reshard_after_forward", config.reshard_after_forward)
    return out


def spmd_kwargs(config: ShardConfig) -> dict[str, Any]:
    if config.xla_fsdp_settings:
        name = next(iter(config.xla_fsdp_settings))
        raise ShardConfigError(
            f"xla_fsdp_settings.{name}",
            "is an XlaFullyShardedDataParallel argument; SPMD FSDPv2 (xla_fsdp_v2: true) takes none of "
            "them (the Trainer does not pass them either). Remove xla_fsdp_settings or set xla_fsdp_v2: false.",
        )
    if not config.reshard_after_forward:
        raise ShardConfigError(
            "reshard_after_forward",
            "is false, but SPMD FSDPv2 has no such setting (the XLA compiler schedules the gathers). "
            "Remove it or set xla_fsdp_v2: false.",
        )
    return {}


def _convert(key: str, value: Any, default: Any) -> Any:
    import torch

    name = key.rsplit(".", 1)[1]
    if name in _DTYPE_SETTINGS:
        if value is None:
            return None
        return getattr(torch, dtype_name(key, value))
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ShardConfigError(key, f"must be true or false, got {show_value(value)}.")
        return value
    if name in ("sharding_rank", "sharding_world_size", "reduce_scatter_bucket_size_mb") or isinstance(default, int):
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise ShardConfigError(key, f"must be a non-negative integer below 2**31, got {show_value(value)}.")
        return value
    if name == "sharding_groups":
        if value is None:
            return None
        if not (
            isinstance(value, list)
            and value
            and all(
                isinstance(g, list) and g and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in g)
                for g in value
            )
        ):
            raise ShardConfigError(key, f"must be a list of lists of device ordinals, got {show_value(value)}.")
        return value
    raise ShardConfigError(key, f"cannot be set from a config (value {show_value(value)}).")  # pragma: no cover


# ---------------------------------------------------------------- helpers


def _plan_policy(model: nn.Module, plan: WrapPlan) -> Callable[..., bool]:
    unit_ids = {id(m) for m in plan.modules(model)}

    def policy(module: nn.Module, recurse: bool, **_: Any) -> bool:
        # recurse everywhere; wrap exactly the plan's units (children first, as recursive_wrap goes)
        return True if recurse else id(module) in unit_ids

    return policy


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


def _strip_wrappers(key: str) -> str:
    for w in ("_orig_module.", "_fsdp_wrapped_module.", "_fpw_module.", "_xla_checkpointed_module."):
        key = key.replace(w, "")
    return key


def _consolidate_fsdp(model: nn.Module, threads: cpu.DeviceThreads | None) -> dict[str, Any]:
    """Gather every rank's shards (``all_gather``) and rebuild full tensors with torch_xla's own
    ``consolidate_sharded_state_dicts``, so the names and shapes are exactly the unwrapped model's."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    sd = model.state_dict()
    meta = model.get_shard_metadata()
    world = xr.world_size()
    if world == 1:
        per_rank = [{k: v.cpu() for k, v in sd.items()}]
    elif threads is not None:
        threads.sync()
        per_rank = threads.exchange(xr.global_ordinal(), {k: v.detach().cpu() for k, v in sd.items()})
    else:
        gathered = {k: xm.all_gather(v.unsqueeze(0), dim=0) for k, v in sd.items()}
        torch_xla.sync()
        per_rank = [{k: g[r].cpu() for k, g in gathered.items()} for r in range(world)]
    full = consolidate_sharded_state_dicts(per_rank, meta)
    return {_strip_wrappers(k): v.detach().cpu().clone() for k, v in full.items()}


def _param_layout(model: nn.Module) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    """Parameter id -> the (name in the unwrapped model, shape) pieces it holds, in order.

    Under SPMD a parameter is one whole tensor. Under XLA FSDP it is a flat, padded shard of one
    parameter (``_orig_name``, ``_orig_size``), or with ``flatten_parameters`` of several, listed
    in the root's ``get_shard_metadata()["flatten_info"]``."""
    flatten_info = {}
    if hasattr(model, "get_shard_metadata"):
        flatten_info = model.get_shard_metadata().get("flatten_info", {})
    out: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for prefix, mod in model.named_modules():
        for local, p in mod.named_parameters(recurse=False):
            orig = getattr(p, "_orig_name", None)
            if orig is None:
                out[id(p)] = [(_strip_wrappers(f"{prefix}.{local}" if prefix else local), tuple(p.shape))]
                continue
            full = f"{prefix}.{orig}" if prefix else orig
            flat_key = full.replace("_fpw_module.", "")
            if flat_key in flatten_info:
                names, shapes, _ = flatten_info[flat_key]
                base = full.rsplit(".", 1)[0]
                out[id(p)] = [(_strip_wrappers(f"{base}.{n}"), tuple(sh)) for n, sh in zip(names, shapes)]
            else:
                out[id(p)] = [(_strip_wrappers(full), tuple(p._orig_size))]
    return out


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds, by unwrapped name."""
    out = {}
    for prefix, mod in model.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[_strip_wrappers(f"{prefix}.{name}" if prefix else name)] = b
    return out


def _to_device_keeping_ties(model: nn.Module, device: Any) -> nn.Module:
    """``model.to(device)``, then share again every parameter that was shared before (tied
    embeddings): moving a model to an XLA device disconnects tied weights (the Trainer re-ties
    them with ``tie_weights()`` for the same reason); this works for any model."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, name))
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=device)  # cpu_ram_efficient_loading, off rank 0: the values come later
    else:
        model.to(device)
    for group in slots.values():
        if len(group) > 1:
            owner, name = group[0]
            shared = owner._parameters[name]
            for mod, n in group[1:]:
                mod._parameters[n] = shared
    return model


def _fsdp_shard(full: torch.Tensor, like: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` laid out like the XLA FSDP shard ``like``: flattened and
    zero-padded to ``world * like.numel()`` then cut in ``world`` chunks (the default), or, with
    ``shard_param_on_dim_0``, padded along dim 0 to ``world * like.shape[0]`` rows and cut there."""
    if like.dim() <= 1 and (full.dim() <= 1 or like.shape[0] != full.shape[0] * world):
        flat = full.detach().reshape(-1)
        n = like.numel()
        padded = torch.zeros(world * n, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        return padded[rank * n : (rank + 1) * n].clone()
    full = full.detach().reshape((-1,) + tuple(like.shape[1:]))
    rows = like.shape[0]
    padded = torch.zeros((world * rows,) + tuple(like.shape[1:]), dtype=full.dtype)
    padded[: full.shape[0]] = full
    return padded[rank * rows : (rank + 1) * rows].clone()


def _like_spmd_param(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` on the XLA device with the same SPMD sharding as ``p``."""
    import torch_xla
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    t = value.to(torch_xla.device(), p.dtype)
    xs.mark_sharding(t, xs.get_global_mesh(), _prepare_spmd_partition_spec(t, shard_maximal=True))
    return t


def _without_ordinal(fn: Callable[[], None], ordinal: int) -> None:
    fn()


def _call_with_ordinal(index: int, fn: Callable[[int], None]) -> None:
    import torch_xla.runtime as xr

    try:
        fn(xr.global_ordinal())
    except BaseException as e:
        if not isinstance(e, DistributedSetupError) or not cpu.aborted():
            # the cause: xmp.spawn re-raises whichever thread's error it collects first, often
            # another device's "stop waiting" that follows from this one
            log.error("shardcore xla: device %d failed", xr.global_ordinal(), exc_info=True)
        # the other device threads would wait for this one at the next step end until the timeout
        cpu.abort_all()
        raise


def _has_tpu() -> bool:
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
