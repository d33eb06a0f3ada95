"""The one training loop both the reference and the sharded run execute.

The reference is plain single-device PyTorch; the sharded run is ``shardcore.shard`` with the
backend under test. Both start from the same seed and see the same global batches: the sharded
run's backend picks each rank's part of the batch (``local_batch``) and reduces scalars
(``all_reduce_sum``), the reference uses :class:`LocalRuntime`, which does neither.

After training, the sharded run's FULL checkpoint goes round trip: through ``shardcore.save`` /
``shardcore.load`` where they exist (and back into the sharded model), else as the backend's
``full_state_dict`` written to a safetensors file; either way it is loaded into a fresh
single-device model, whose outputs on a probe batch are compared with the reference's.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import math
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardcore.capabilities import GlobalGradSquares, StepEnd
from shardcore.ties import retie_like

from .cases import Case
from .comm import autograd_facts, counts_tp_collectives, recorder_for
from .effects import ModelWrites, ModuleCalls, compute_dtype_name, group_timeout, holder_classes, other_weights
from .hardware import DEVICE_ENV, hardware
from .models import build_model, forward_output, is_lora, lora_base_of, loss_fn, make_batches, probe_batch

#: environment variables the suite sets for its workers
REFERENCE_DEVICE_ENV = "SHARDCORE_CONFORMANCE_REFERENCE_DEVICE"  # where the reference runs (default cpu)
SCRATCH_ENV = "SHARDCORE_CONFORMANCE_SCRATCH"  # a directory every rank sees, for checkpoints
PROGRESS_ENV = "SHARDCORE_CONFORMANCE_PROGRESS"  # a file rank 0 appends a line to after each case

#: AdamW's eps, chosen so that the comparison measures sharding and not the order of rounding.
#: AdamW moves each coordinate by lr * m / (sqrt(v) + eps), so a gradient entry near zero turns an
#: absolute gradient difference dg into a parameter difference of up to lr * dg / eps. Two correct
#: implementations sum a gradient in another order (XLA:CPU's fused code vs eager ATen, AVX2 vs
#: AVX-512 kernels, a reduce-scatter vs one local sum): dg ~ 5e-8 on GPT-2's attention output bias,
#: whose 64 token terms are ~0.1. At eps 1e-6 (gain lr/eps = 1e4) that became 5.1e-5 after one step
#: and 1.7e-4 after five, a verdict decided by the CPU. At eps 1e-4 (gain 100) the same run differs
#: by 4.1e-6, while every real gradient here (>= 1e-3 on the entries that matter) still takes
#: AdamW's full-size, sign-like step. docs/numerics.md has the measurements.
ADAM_EPS = 1e-4


class LocalRuntime:
    """Single-device stand-in for a backend's batch and reduction hooks."""

    world_size = 1

    def __init__(self, device: str | torch.device | None = None):
        self.device = torch.device(device or os.environ.get(REFERENCE_DEVICE_ENV, "cpu"))

    def local_batch(self, batch):
        return {k: v.to(self.device) for k, v in batch.items()}

    def all_reduce_sum(self, t):
        return t

    def full_state_dict(self, model: nn.Module):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def local_grad_sq_sum(model: nn.Module) -> torch.Tensor:
    """Sum of squared gradient entries this rank holds (its shards, for a sharded model)."""
    total = None
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "to_local"):
            g = g.to_local()
        s = g.detach().float().pow(2).sum()
        total = s if total is None else total + s
    if total is None:
        return torch.zeros(())
    return total


def global_grad_sq_sum(runtime: Any, model: nn.Module, device: Any) -> torch.Tensor:
    """Sum of squared gradient entries over the whole model. A backend whose ranks do not hold
    disjoint shards (replication, hybrid sharding) computes it itself (GlobalGradSquares);
    otherwise each rank's own entries are summed over ranks."""
    if isinstance(runtime, GlobalGradSquares):
        return runtime.grad_sq_sum(model)
    return runtime.all_reduce_sum(local_grad_sq_sum(model).to(device))


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """Multiplier of the base lr at ``step`` (0-based): ``warmup_cosine`` warms up linearly over
    the first 2 steps, then decays along a half cosine to 0 at ``steps``."""
    if schedule == "constant":
        return 1.0
    warmup = 2
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def freeze(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """``requires_grad=False`` on every parameter whose name matches a pattern; the frozen names."""
    if not patterns:
        return []
    names = [n for n, p in model.named_parameters() if any(fnmatch.fnmatch(n, pat) for pat in patterns)]
    unmatched = [pat for pat in patterns if not any(fnmatch.fnmatch(n, pat) for n in names)]
    if unmatched:
        raise ValueError(f"frozen patterns {unmatched} match no parameter of {type(model).__name__}")
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(False)
    return names


def run_case(case: Case, backend: Any | None, rank: int = 0) -> dict[str, Any]:
    """Train ``case`` and return per-step losses, gradient norms, learning rates, the final full
    parameters and buffers, what the modules did in the first step (:mod:`.effects`), and (sharded)
    the checkpoint round trip or (reference) probe outputs.

    ``backend`` None runs the single-device reference; otherwise the backend name (or
    ``module:Class``) given to ``shardcore.shard``. ``rank``: this worker's rank (a device thread's
    ordinal), known before anything is sharded. A case with ``resume_at`` saves the sharded model
    and its optimizer after that many steps, builds a new model and optimizer, loads them and trains
    on: the result must be the uninterrupted reference's.
    """
    import shardcore

    t0 = time.time()
    model = build_model(case.model, case.seed)
    classes = holder_classes(model)
    freeze(model, case.frozen)
    # the case's patterns, and what the model froze itself (a PEFT model's base): all must stay as they were
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    cfg = shardcore.parse_config(case.config)
    recorder = compiled = None
    units: list[dict[str, Any]] = []
    if backend is None:
        # a case that trains on the CPU whatever the run certifies (use_cpu) is compared with the CPU
        runtime: Any = LocalRuntime("cpu" if cfg.use_cpu else None)
        model.to(runtime.device)
        world_size = 1
        units = _unit_facts(case, model, runtime)
    else:
        compiled = _CompileCounter(case)
        model = _sharded(case, model, backend, rank)
        runtime = shardcore.handle(model).backend
        world_size = runtime.world().size
        recorder = recorder_for(runtime, world_size, tensor_parallel=counts_tp_collectives(cfg))
    opt = _optimizer(case, model)
    sched = _schedule(case, opt)
    # compiled units would trace the hooks into their graphs (dynamo), and recompute without Python
    calls = None
    if not cfg.torch_compile:
        paths = tuple(u["path"] for u in units if u["path"]) if backend is None else ()
        calls = ModuleCalls(model, classes, by_name=backend is None, units=paths)
    compute_dtype = _reference_compute_dtype(case) if backend is None else None
    step_end = runtime.step_end if isinstance(runtime, StepEnd) else None  # lazy tensors: cut the step's graph
    losses, grad_norms, clip_norms, lrs = [], [], [], []
    placement: dict[str, Any] | None = None
    facts: dict[str, Any] = {}
    for step, batch in enumerate(make_batches(case.model, case.steps, case.global_batch, case.seed)):
        if backend is not None and step and step == case.resume_at:
            model, opt, sched = _resumed(case, model, opt, backend, rank, facts)
        step_loss = None
        micros = _micro_batches(batch, case.grad_accum)
        if recorder is not None:
            recorder.begin_step()
        observing = calls.recording() if calls is not None and step == 0 else contextlib.nullcontext()
        with observing, _whole_recomputation(step == 0 or cfg.tp_size > 1):
            for i, micro in enumerate(micros):
                # only the step's forward and backward communicate for the sharding; the suite's own
                # reductions of metrics below are not counted
                counting = recorder.recording() if recorder is not None else contextlib.nullcontext()
                with counting, _accumulating(model, backend, last=i == len(micros) - 1):
                    if compute_dtype is None:
                        local = runtime.local_batch(micro)
                        loss = loss_fn(case.model, model, local)
                        if placement is None:
                            placement = _placement_of(local, loss)
                        (loss / case.grad_accum).backward()
                    else:
                        loss = _low_precision_step(case, model, runtime.local_batch(micro), compute_dtype)
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        if calls is not None and step == 0:
            calls.uninstall()
        if recorder is not None:
            recorder.after_backward(model)
        if placement is not None and "params" not in placement:
            placement.update(_model_placement(model, _serving(backend, case)))
        gsq = global_grad_sq_sum(runtime, model, step_loss.device)
        clip_norm = _clip(case, model, backend)
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step_end is not None:
            step_end()
        losses.append(float(runtime.all_reduce_sum(step_loss / case.grad_accum) / world_size))
        grad_norms.append(float(gsq.sqrt()))
        if clip_norm is not None:
            clip_norms.append(float(clip_norm))
        if compiled is not None:
            compiled.step_done()
    if recorder is not None:
        recorder.uninstall()
    state = runtime.full_state_dict(model)
    params = {k: v.detach().float().cpu() for k, v in state.items()}
    out: dict[str, Any] = {"losses": losses, "grad_norms": grad_norms, "lrs": lrs, "params": params, "frozen": frozen}
    if case.max_grad_norm is not None:
        out["clip_norms"] = clip_norms
    probe = probe_batch(case.model, seed=case.seed)
    if backend is None:
        out["units"] = units
        if calls is not None:
            out["modules"] = calls.record()
        with torch.no_grad():
            out["probe"] = forward_output(case.model, model, runtime.local_batch(probe)).cpu()
    else:
        out["comm"] = {
            "pattern": getattr(runtime, "communication_pattern", None),
            # SPMD: one rank, and its program's collectives run over the devices
            "world_size": getattr(recorder, "world_size", world_size),
            "ranks": _every_rank(runtime, recorder.steps) if recorder is not None else [],
        }
        if calls is not None:
            out["modules"] = _every_rank(runtime, calls.record())
        out["compile"] = {"graphs_per_step": compiled.graphs_per_step}
        out["placement"] = {
            "requested": os.environ.get(DEVICE_ENV, ""),
            "devices": _device_count(runtime),
            "ranks": _every_rank(runtime, {**(placement or {}), "hardware": hardware(runtime.world().device)}),
        }
        out["timeout"] = group_timeout()
        out["other_weights"] = bool(cfg.cpu_ram_efficient_loading and not case.empty_weights and world_size > 1)
        out["resumed_at"] = case.resume_at or None
        if "async_save" in facts:
            out["async_save"] = _every_rank(runtime, facts["async_save"])
        out["checkpoint"] = checkpoint_round_trip(case, model, runtime, state, probe, step_end)
    _note_progress(case, backend, runtime, time.time() - t0)
    return out


def fresh_model(case: Case) -> nn.Module:
    """A model whose every weight that a checkpoint of ``case`` holds differs from the seed's, so that
    loading must overwrite each: another seed, or for a LoRA case (whose FULL checkpoint holds only the
    adapter; the base is what the user loads from elsewhere) the seed's base with shifted adapters."""
    if not is_lora(case.model):
        return build_model(case.model, case.seed + 1)
    model = build_model(case.model, case.seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    return model


def _whole_recomputation(first_step: bool) -> Any:
    """In the observed first step, a checkpointed unit recomputes its whole forward: non-reentrant
    ``torch.utils.checkpoint`` otherwise stops once it has what backward needs, so how many modules
    run again would depend on the unit's last ones. The values computed are the same either way.
    Tensor-parallel cases recompute whole units in every step: the collectives a recomputation
    runs are counted, and an early stop would skip a unit's trailing ones."""
    if not first_step:
        return contextlib.nullcontext()
    from torch.utils.checkpoint import set_checkpoint_early_stop

    return set_checkpoint_early_stop(False)


def _optimizer(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.01, eps=ADAM_EPS)


def _schedule(case: Case, opt: torch.optim.Optimizer, done: int = 0) -> Any:
    """The case's schedule, ``done`` steps in (a resumed run's new optimizer starts where the saved one was)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(case.lr_schedule, s + done, case.steps))


def _sharded(case: Case, model: nn.Module, backend: Any, rank: int) -> nn.Module:
    """``model`` (frozen as the case says) sharded by ``backend``. ``empty_weights``: every rank builds
    it again without weights and reads the seed's from a FULL checkpoint. ``cpu_ram_efficient_loading``:
    the ranks other than 0 hold other weights, which the key says are replaced by rank 0's."""
    import shardcore

    weights = _without_weights(case, model) if case.empty_weights else None
    if weights is not None:
        model, weights = weights
        freeze(model, case.frozen)
    elif rank != 0 and shardcore.parse_config(case.config).cpu_ram_efficient_loading:
        other_weights(model)
    model = shardcore.shard(model, case.config, backend=backend)
    if weights is not None:
        shardcore.load(model, weights)
    return model


def _resumed(
    case: Case, model: nn.Module, opt: torch.optim.Optimizer, backend: Any, rank: int, facts: dict[str, Any]
) -> tuple:
    """Save ``model`` and ``opt`` after ``case.resume_at`` steps (in the config's format), then build a
    new model from another seed, shard it, give it a new optimizer and schedule, and load both. With
    ``async_save``, ``facts["async_save"]`` says which threads wrote the model's files
    (:class:`.effects.ModelWrites`)."""
    import shardcore

    path = _scratch_dir(case) / "resume"
    manager = writes = None
    if shardcore.parse_config(case.config).async_save:
        # through a CheckpointManager, which writes in the background by the config's key; the old
        # model then changes in place, as the next step would, while the write may still go on
        manager = shardcore.CheckpointManager(path, keep_last=1)
        writes = ModelWrites(path).start()  # until restore() has finished the write
        with writes.save():
            manager.save(case.resume_at, model, opt)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    else:
        shardcore.save(model, path, opt)
    fresh = fresh_model(case)
    freeze(fresh, case.frozen)
    fresh = _sharded(replace(case, empty_weights=False), fresh, backend, rank)
    new_opt = _optimizer(case, fresh)
    if manager is None:
        shardcore.load(fresh, path, new_opt)
    else:
        try:
            manager.restore(fresh, new_opt)  # first finishes the write in flight
        finally:
            writes.stop()
        manager.close()
        facts["async_save"] = writes.facts()
    return fresh, new_opt, _schedule(case, new_opt, done=case.resume_at)


def _types(tensors: Any) -> list[str]:
    return sorted({t.device.type for t in tensors})


def _placement_of(batch: dict[str, torch.Tensor], loss: torch.Tensor) -> dict[str, Any]:
    """Where the step's inputs and loss lived, and (XLA) how the inputs were sharded over the devices."""
    out: dict[str, Any] = {"batch": _types(batch.values()), "loss": loss.device.type}
    if any(t.device.type == "xla" for t in batch.values()):
        import torch_xla

        out["batch_sharding"] = sorted({torch_xla._XLAC._get_xla_sharding_spec(t) for t in batch.values()})
    return out


def _model_placement(model: nn.Module, backend: Any = None) -> dict[str, Any]:
    """Where this rank's parameters and gradients lived (a DTensor's local shard)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(model.parameters())
    out: dict[str, Any] = {
        "params": _types(local(p) for p in params),
        "grads": _types(local(p.grad) for p in params if p.grad is not None),
    }
    # under the model's own names, where the backend's wrappers renamed them
    # under the model's own names, where the backend's wrappers renamed them (a tied weight under
    # the name it is tied to, as named_parameters gives it)
    names, ties = getattr(backend, "original_names", None), getattr(backend, "tied_aliases", None)
    original = names(model) if names is not None else {}
    aliases = ties(model) if ties is not None else {}
    split = {}
    for n, p in model.named_parameters():
        d = _xla_tp_split(p) if p.device.type == "xla" else _tp_split(p)
        if d is not None:
            name = original.get(n, [n])[0]
            split[aliases.get(name, name)] = d
    if split:  # tensor parallelism: which dim of each weight the tp ranks split
        out["tp_split"] = split
    return out


def _tp_split(p: torch.Tensor) -> int | None:
    """The dim of ``p`` that its mesh's ``"tp"`` dim splits (None: none, or no such mesh dim)."""
    mesh = getattr(p, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" not in names:
        return None
    placement = p.placements[names.index("tp")]
    return placement.dim if placement.is_shard() else None


def _serving(backend: Any, case: Case) -> Any:
    """The implementation that serves ``case`` where ``backend`` is a name for several."""
    if backend is None:
        return None
    import shardcore
    from shardcore.backend import for_config, get_backend

    named = get_backend(backend) if isinstance(backend, str) else backend
    return for_config(named, shardcore.parse_config(case.config))


def _xla_tp_split(p: torch.Tensor) -> int | None:
    """SPMD: the dim of ``p`` along which device 0 and device 1 hold different parts. The devices of
    one tensor-parallel group are neighbours (``tensor`` is the innermost mesh axis, as FSDP2's
    ``tp``), so that is the dim the group splits; None: they hold the same part, or one process does
    not hold both devices."""
    import torch_xla

    if "devices=" not in torch_xla._XLAC._get_xla_sharding_spec(p):
        return None
    where = torch_xla._XLAC._get_local_shard_replica_and_indices([p])[0]
    if len(where) < 2 or where[0][1] is Ellipsis or where[1][1] is Ellipsis:
        return None
    differ = [i for i, (a, b) in enumerate(zip(where[0][1], where[1][1])) if (a.start, a.stop) != (b.start, b.stop)]
    return differ[0] if len(differ) == 1 else None


def _device_count(runtime: Any) -> int:
    """Devices the sharded run spans: SPMD's one rank drives them all."""
    if getattr(runtime, "communication_pattern", None) == "spmd":
        import torch_xla.runtime as xr

        return xr.global_runtime_device_count()
    return runtime.world().size


def _unit_facts(case: Case, model: nn.Module, runtime: LocalRuntime) -> list[dict[str, Any]]:
    """The plan's units with what the single-device model's first micro-batch says about them (which
    the backward reaches, which parameters get a gradient): what the communication check predicts from."""
    import shardcore
    from shardcore.plan import build_plan

    plan = build_plan(model, shardcore.parse_config(case.config))
    batch = _micro_batches(make_batches(case.model, 1, case.global_batch, case.seed)[0], case.grad_accum)[0]
    return autograd_facts(model, plan, lambda m: loss_fn(case.model, m, runtime.local_batch(batch)).backward())


def _every_rank(runtime: Any, steps: list[Any]) -> list[Any]:
    """Each rank's communication record, by rank (a backend without ``all_gather_object``: its own)."""
    gather = getattr(runtime, "all_gather_object", None)
    return gather(steps) if gather is not None else [steps]


class _CompileCounter:
    """Graphs dynamo compiled in each optimizer step (``torch._dynamo``'s ``unique_graphs``). A
    compiled case starts from empty dynamo caches, so that earlier cases in this process neither
    count nor use up the recompile limit of a unit class's ``forward``, whose code every case that
    compiles that class shares (with cached code, a case would compile nothing and fail the check)."""

    def __init__(self, case: Case) -> None:
        import shardcore

        self.graphs_per_step: list[int] = []
        if shardcore.parse_config(case.config).torch_compile:
            import torch._dynamo

            torch._dynamo.reset()
        self._last = self._graphs()

    @staticmethod
    def _graphs() -> int:
        import sys

        dynamo = sys.modules.get("torch._dynamo")
        return int(dynamo.utils.counters["stats"]["unique_graphs"]) if dynamo is not None else 0

    def step_done(self) -> None:
        now = self._graphs()
        self.graphs_per_step.append(now - self._last)
        self._last = now


def _without_weights(case: Case, model: nn.Module) -> tuple[nn.Module, Path]:
    """``empty_weights``: this rank writes the seed's weights as a FULL checkpoint of its own (no
    collective is needed before ``shard``), then builds the model again without weights."""
    import shardcore
    from shardcore.distributed import env_world

    from .models import _BUILD_LOCK, spec

    path = _scratch_dir(case) / f"initial-rank{env_world()[0]}"
    shardcore.save(model, path)
    with _BUILD_LOCK, shardcore.init_empty_weights():
        return spec(case.model).build(), path


def _accumulating(model: nn.Module, backend: Any, last: bool) -> Any:
    """Every micro-batch but the last of a step accumulates without gradient reduction (on the
    sharded side; the reference has nothing to reduce)."""
    if last or backend is None:
        return contextlib.nullcontext()
    import shardcore

    return shardcore.no_sync(model)


def _clip(case: Case, model: nn.Module, backend: Any) -> torch.Tensor | None:
    """Clip as the case asks: torch's own function on the single-device reference, shardcore's on
    the sharded model. The norm before clipping, or None."""
    if case.max_grad_norm is None:
        return None
    if backend is None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm, case.norm_type)
    import shardcore

    return shardcore.clip_grad_norm_(model, case.max_grad_norm, case.norm_type)


def _note_progress(case: Case, backend: Any, runtime: Any, seconds: float) -> None:
    """One JSON line per finished case in the suite's progress file (rank 0), which the suite
    follows while the workers run."""
    path = os.environ.get(PROGRESS_ENV)
    if not path or (backend is not None and runtime.world().rank != 0):
        return
    line = json.dumps(
        {"side": "reference" if backend is None else str(backend), "case": case.name, "seconds": round(seconds, 2)}
    )
    with open(path, "a") as f:
        f.write(line + "\n")


def _micro_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    if n == 1:
        return [batch]
    rows = next(iter(batch.values())).shape[0] // n
    return [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(n)]


def _scratch_dir(case: Case) -> Path:
    """A directory every rank of this run sees: the suite's scratch directory (set for all workers),
    else one named after this process group's port."""
    root = os.environ.get(SCRATCH_ENV) or os.path.join(
        tempfile.gettempdir(), f"shardcore-conformance-{os.environ.get('MASTER_PORT', os.getpid())}"
    )
    return Path(root) / case.name


def checkpoint_round_trip(
    case: Case, model: nn.Module, runtime: Any, state: dict[str, Any], probe, step_end=None
) -> dict[str, Any]:
    """Save the sharded model's FULL checkpoint, load it into a fresh single-device model (rank 0)
    and report how far its state is from ``state`` (the sharded model's own full state dict) and
    its outputs on ``probe``. With ``shardcore.save``/``load``, the checkpoint is also loaded back
    into the sharded model after its parameters were zeroed, and compared again. Collective."""
    import shardcore

    rank = runtime.world().rank
    scratch = _scratch_dir(case)
    path = scratch / "checkpoint"
    out: dict[str, Any] = {"reload_param_diff": None}
    use_api = hasattr(shardcore, "save") and hasattr(shardcore, "load")
    kind = shardcore.handle(model).config.state_dict_type
    fresh_via_api = use_api and kind == "FULL_STATE_DICT"
    merged = None
    if use_api and kind == "FULL_STATE_DICT" and is_lora(case.model):
        merged = scratch / "merged"
        shardcore.save(model, merged, merged=True)
    if use_api:
        shardcore.save(model, path)
        with torch.no_grad():
            for p in model.parameters():
                if merged is None or p.requires_grad:  # an adapter checkpoint holds the adapter only
                    p.zero_()
        if step_end is not None:
            step_end()
        shardcore.load(model, path)
        again = runtime.full_state_dict(model)
        if rank == 0:
            out["reload_param_diff"] = _max_diff(state, again)
    out["method"] = (f"shardcore.save/load {kind} (reload into the sharded model); " if use_api else "") + (
        "shardcore.load into a fresh single-device model"
        if fresh_via_api
        else "full_state_dict -> safetensors -> fresh single-device model"
    )
    if rank != 0:
        return out
    fresh = fresh_model(case)
    if fresh_via_api:
        shardcore.load(fresh, path)
    else:
        from safetensors.torch import load_file, save_file

        scratch.mkdir(parents=True, exist_ok=True)
        f = scratch / "full_state_dict.safetensors"
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(f))
        fresh.load_state_dict(load_file(str(f)), strict=True)
    out["fresh_param_diff"] = _max_diff(state, fresh.state_dict())
    here = LocalRuntime()  # on the reference's device, so that outputs compare like with like
    fresh.to(here.device)
    with torch.no_grad():
        out["probe"] = forward_output(case.model, fresh, here.local_batch(probe)).cpu()
    if merged is not None:
        out.update(_peft_round_trips(case, path, merged, here, probe))
    return out


def _peft_round_trips(case: Case, adapter: Path, merged: Path, here: LocalRuntime, probe) -> dict[str, Any]:
    """A LoRA case's FULL checkpoint as the PEFT and Transformers user loads it: the adapter directory
    with ``PeftModel.from_pretrained`` onto the seed's base, the merged export with
    ``AutoModelForCausalLM.from_pretrained``; the outputs of each on the probe batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .models import _BUILD_LOCK

    with _BUILD_LOCK:
        torch.manual_seed(case.seed)  # the base build_model's PEFT model wraps: the same draws, first
        base = lora_base_of(case.model)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(base, str(adapter)).to(here.device)
        plain = AutoModelForCausalLM.from_pretrained(str(merged)).to(here.device)
        batch = here.local_batch(probe)
        return {
            "peft_probe": forward_output(case.model, peft_model, batch).cpu(),
            "merged_probe": forward_output(case.model, plain, batch).cpu(),
            "adapter_bytes": sum(f.stat().st_size for f in adapter.glob("adapter_model*.safetensors")),
            "merged_bytes": sum(f.stat().st_size for f in merged.glob("model*.safetensors")),
        }


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest absolute difference over the keys of ``a`` (inf if ``b`` lacks one or a shape differs)."""
    worst = 0.0
    for k, v in a.items():
        w = b.get(k)
        if w is None or tuple(w.shape) != tuple(v.shape):
            return math.inf
        if v.numel():
            d = float((v.detach().cpu().double() - w.detach().cpu().double()).abs().max())
            if not math.isnan(worst) and not d <= worst:  # a NaN, once seen, stays the worst
                worst = d
    return worst


def _reference_compute_dtype(case: Case) -> torch.dtype | None:
    """The parameter dtype a mixed-precision case computes in (None: full precision): the
    ``mixed_precision`` param dtype, or the XLA ``xla_fsdp_settings`` compute dtype."""
    from shardcore import parse_config

    name = compute_dtype_name(parse_config(case.config))
    return getattr(torch, name) if name else None


def _low_precision_step(case: Case, model: nn.Module, batch, dtype: torch.dtype) -> torch.Tensor:
    """Single-device mixed precision as FSDP2 does it: fp32 master parameters, forward and backward
    on a copy whose parameters are cast to ``dtype`` (buffers stay shared with the master, in their
    own dtype), gradients cast back to fp32 and accumulated for the optimizer step."""
    low = copy.deepcopy(model)
    for (_, m_master), (_, m_low) in zip(model.named_modules(), low.named_modules()):
        for name in list(m_low._buffers):
            m_low._buffers[name] = m_master._buffers[name]  # e.g. a forward counter keeps counting
        for name, p in m_low._parameters.items():
            if p is not None and p.is_floating_point():
                m_low._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    retie_like(model, low)
    # FSDP2's MixedPrecisionPolicy casts floating-point forward inputs too (cast_forward_inputs)
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}
    loss = loss_fn(case.model, low, batch)
    (loss / case.grad_accum).backward()
    low_params = dict(low.named_parameters())
    for n, p in model.named_parameters():
        q = low_params[n]
        if q.grad is not None:
            g = q.grad.float()
            p.grad = g if p.grad is None else p.grad + g
    return loss
