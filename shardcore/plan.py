"""``WrapPlan``: which submodules become sharding units, decided once from model + config.

Backends receive the plan and apply it; they never re-decide wrapping. Units are listed children
first (post-order), the order in which ``fully_shard``-style APIs must be applied, and the root comes
last and takes every parameter no unit took.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch
from torch import nn

from .config import ShardConfig
from .errors import WrapPlanError
from .ties import tie_groups
from .tp import TPPlan, build_tp_plan

# As torch's size_based_auto_wrap_policy: containers are never units themselves.
_CONTAINER_TYPES = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class Unit:
    """One sharding unit: the module at ``path`` (``""`` is the root) and the parameters it owns
    (those in its subtree that no nested unit took)."""

    path: str
    cls: str
    num_params: int
    param_names: tuple[str, ...] = field(repr=False, default=())

    @property
    def is_root(self) -> bool:
        return self.path == ""


@dataclass(frozen=True)
class WrapPlan:
    policy: str
    units: tuple[Unit, ...]  # children first, root excluded
    root: Unit
    #: tensor parallelism's split (``tp_size`` > 1), applied before the units are sharded
    tp: TPPlan | None = None

    def all_units(self) -> tuple[Unit, ...]:
        return self.units + (self.root,)

    def modules(self, model: nn.Module) -> list[nn.Module]:
        """The unit modules of ``model`` in application order (root excluded)."""
        return [model.get_submodule(u.path) for u in self.units]

    def describe(self) -> str:
        rows = [f"policy: {self.policy}", f"{'unit':<48} {'class':<28} {'params':>12}"]
        for u in self.all_units():
            rows.append(f"{(u.path or '<root>'):<48} {u.cls:<28} {u.num_params:>12,}")
        if self.tp is not None:
            rows.append(self.tp.describe())
        return "\n".join(rows)


def build_plan(model: nn.Module, config: ShardConfig) -> WrapPlan:
    """Decide the sharding units of ``model`` under ``config``'s wrap policy."""
    policy = config.auto_wrap_policy
    if policy == "NO_WRAP":
        chosen: list[str] = []
    elif policy == "TRANSFORMER_BASED_WRAP":
        classes = _transformer_classes(model, config)
        chosen = [name for name, mod in _post_order(model) if name and type(mod).__name__ in classes]
    elif policy == "SIZE_BASED_WRAP":
        chosen = _size_based(model, config.min_num_params)
    else:  # pragma: no cover - ShardConfig validated it
        raise WrapPlanError("auto_wrap_policy", f"unknown policy {policy!r}")
    _check_no_shared_params(model, chosen)
    return replace(_make_plan(model, policy, chosen), tp=build_tp_plan(model, config))


def _transformer_classes(model: nn.Module, config: ShardConfig) -> set[str]:
    present = {type(m).__name__ for m in model.modules()}
    if config.transformer_layer_cls_to_wrap:
        classes = list(config.transformer_layer_cls_to_wrap)
        missing = [c for c in classes if c not in present]
        if missing:
            raise WrapPlanError(
                "transformer_layer_cls_to_wrap",
                f"{missing!r} is not the class of any submodule of {type(model).__name__}. Classes in "
                f"the model: {', '.join(sorted(present))}. Fix the class name.",
            )
        return set(classes)
    no_split = _no_split_modules(model)
    if not no_split:
        raise WrapPlanError(
            "transformer_layer_cls_to_wrap",
            f"auto_wrap_policy TRANSFORMER_BASED_WRAP needs layer classes, but none were given and "
            f"{type(model).__name__} has no _no_split_modules. Set transformer_layer_cls_to_wrap "
            "(e.g. the decoder layer class), or use SIZE_BASED_WRAP / NO_WRAP.",
        )
    found = {c for c in no_split if c in present}
    if not found:
        raise WrapPlanError(
            "transformer_layer_cls_to_wrap",
            f"{type(model).__name__}._no_split_modules = {sorted(no_split)!r} names no class in the "
            "model. Set transformer_layer_cls_to_wrap explicitly.",
        )
    return found


def _no_split_modules(model: nn.Module) -> set[str]:
    # Transformers collects _no_split_modules from nested PreTrainedModels (e.g. a vision tower);
    # do the same so a composite model is wrapped by all of its parts' layer classes.
    out: set[str] = set()
    for m in model.modules():
        ns = getattr(m, "_no_split_modules", None)
        if ns:
            out.update(ns)
    return out


def _post_order(module: nn.Module, prefix: str = "") -> Iterable[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _size_based(model: nn.Module, min_num_params: int) -> list[str]:
    """torch's ``size_based_auto_wrap_policy``: a module becomes a unit when the parameters in its
    subtree not already taken by a nested unit reach ``min_num_params``."""
    chosen: list[str] = []

    def visit(mod: nn.Module, path: str) -> dict[int, int]:
        # id -> numel of the subtree's parameters that no nested unit took (a dict, so a parameter
        # reached twice is counted once)
        free = {id(p): p.numel() for p in mod.parameters(recurse=False)}
        for name, child in mod.named_children():
            free.update(visit(child, f"{path}.{name}" if path else name))
        if path and not isinstance(mod, _CONTAINER_TYPES) and sum(free.values()) >= min_num_params:
            chosen.append(path)
            return {}
        return free

    visit(model, "")
    return chosen


def _check_no_shared_params(model: nn.Module, chosen: list[str]) -> None:
    """A parameter shared between a unit and something outside it (tied embeddings) cannot be
    sharded by both; such units are refused with the names, instead of failing deep in a backend."""
    groups = tie_groups(model)
    for path in chosen:
        for group in groups:
            inside = [s for s in group if _within(s.path, path)]
            outside = {s.path for s in group if not _within(s.path, path)}
            if inside and outside:
                pname = inside[0].name[len(path) + 1 :] if path else inside[0].name
                raise WrapPlanError(
                    "auto_wrap_policy",
                    f"unit {path!r} holds parameter {pname!r}, which is shared with {sorted(outside)!r} "
                    "outside that unit (tied weights). Pick layer classes or a min_num_params that keep "
                    "tied modules out of the units, so they are sharded with the root.",
                )


def _within(name: str, unit_path: str) -> bool:
    return name == unit_path or name.startswith(unit_path + ".")


def _make_plan(model: nn.Module, policy: str, chosen: list[str]) -> WrapPlan:
    names = {id(p): n for n, p in model.named_parameters()}
    assigned: set[int] = set()
    units = []
    for path in chosen:  # post-order: nested units come first and keep their parameters
        mod = model.get_submodule(path)
        mine = [p for p in mod.parameters() if id(p) not in assigned]
        assigned.update(id(p) for p in mine)
        units.append(Unit(path, type(mod).__name__, sum(p.numel() for p in mine), tuple(names[id(p)] for p in mine)))
    rest = [p for p in model.parameters() if id(p) not in assigned]
    root = Unit("", type(model).__name__, sum(p.numel() for p in rest), tuple(names[id(p)] for p in rest))
    return WrapPlan(policy, tuple(units), root)


# ---------------------------------------------------------------- memory estimate


@dataclass(frozen=True)
class MemoryEstimate:
    world_size: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    full_param_bytes: int
    full_optim_bytes: int = 0

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    def async_staging_bytes(self, state_dict_type: str) -> int:
        """CPU memory that ``CheckpointManager(async_save=True)`` holds while it writes, on the rank
        that holds the most: every rank copies its own shards of the model and the AdamW state (FSDP2
        keeps the copy from one save to the next); FULL gathers the whole of both on rank 0 besides,
        in the background on FSDP2 and before ``save`` returns elsewhere."""
        shards = self.param_bytes + self.optim_bytes
        if state_dict_type == "SHARDED_STATE_DICT":
            return shards
        return shards + self.full_param_bytes + self.full_optim_bytes


def estimate_memory(
    model: nn.Module, world_size: int, optim_state_dtype: torch.dtype = torch.float32, tp: TPPlan | None = None
) -> MemoryEstimate:
    """Bytes per rank (the largest, rank 0) of parameters, gradients and AdamW state after sharding.

    FSDP-style sharding splits every parameter along dim 0 in ``world_size`` chunks of
    ``ceil(dim0 / world_size)`` rows, so rank 0 holds the largest chunk; AdamW keeps ``exp_avg`` and
    ``exp_avg_sq`` per trainable element (the scalar ``step`` is ignored). With tensor parallelism
    (``tp``), a split parameter's tp slice (its split dim divided by ``tp.size``) is what is sharded.
    """
    if world_size < 1:
        raise WrapPlanError("world_size", f"must be >= 1, got {world_size}.")
    pbytes = gbytes = obytes = full = full_optim = 0
    seen: set[int] = set()
    state_item = torch.empty((), dtype=optim_state_dtype).element_size()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        full += p.numel() * p.element_size()
        shape = tp.local_shape(name, p.shape) if tp is not None else list(p.shape)
        if p.dim() == 0:
            local = p.numel()
        else:
            rows = math.ceil(shape[0] / world_size)
            local = rows * (math.prod(shape) // shape[0] if shape[0] else 0)
        pbytes += local * p.element_size()
        if p.requires_grad:
            gbytes += local * p.element_size()
            obytes += 2 * local * state_item
            full_optim += 2 * p.numel() * state_item
    return MemoryEstimate(world_size, pbytes, gbytes, obytes, full, full_optim)
