"""``TPPlan``: which modules tensor parallelism splits, and how, decided once from model + config.

Like the wrap plan, the split is decided in the core and validated before anything is sharded.
Backends only translate it: FSDP2 into DTensor ``parallelize_module`` styles on the ``tp`` mesh
dim, before ``fully_shard`` on the data-parallel dims (torchtitan's order).

The plan is ``tp_plan`` from the config, or with ``tp_plan: auto`` the model's own: transformers'
``model.tp_plan`` (its ``_tp_plan`` merged with ``config.base_model_tp_plan``, under full module
names). Patterns are matched as transformers matches them: ``*`` stands for one dotted part of the
name, the layer number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from torch import nn

from .config import ShardConfig, show_value
from .config.fields import check_tp_style
from .errors import ShardConfigError
from .ties import tie_groups

#: style -> (module type it applies to, which dim of the weight it splits)
_SPLITS = {
    "colwise": (nn.Linear, 0),
    "colwise_gather_output": (nn.Linear, 0),
    "colwise_rep": (nn.Linear, 0),
    "rowwise": (nn.Linear, 1),
    "rowwise_split_input": (nn.Linear, 1),
    "rowwise_rep": (nn.Linear, 1),
    "embedding_rowwise": (nn.Embedding, 0),
    "embedding_colwise": (nn.Embedding, 1),
}
#: config attributes that count attention heads: every tp rank must hold whole heads
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class TPPlan:
    """``styles``: module name -> style, for every module the plan splits, in module order."""

    size: int
    styles: tuple[tuple[str, str], ...]
    source: str  # where the patterns came from, for messages: "tp_plan" or "the model's tp_plan"

    def as_dict(self) -> dict[str, str]:
        return dict(self.styles)

    def split_dims(self) -> dict[str, int]:
        """Parameter name -> the dim of it that the tp ranks split (weights only; a colwise bias is
        split along its one dim, a rowwise bias is kept whole)."""
        out = {}
        for name, style in self.styles:
            kind, dim = _SPLITS[style]
            out[f"{name}.weight"] = dim
            if kind is nn.Linear and dim == 0:
                out[f"{name}.bias"] = 0
        return out

    def local_shape(self, name: str, shape: tuple[int, ...] | list[int]) -> list[int]:
        """The part of parameter ``name`` one tp rank holds (what data-parallel sharding then splits)."""
        dim = self.split_dims().get(name)
        return [n // self.size if i == dim else n for i, n in enumerate(shape)]

    def describe(self) -> str:
        rows = [f"tensor parallel: tp_size {self.size}, from {self.source}"]
        rows += [f"  {name:<46} {style}" for name, style in self.styles]
        return "\n".join(rows)


def pattern_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + r"\Z")


def model_tp_plan(model: nn.Module) -> Mapping[str, str] | None:
    """The model's own plan under full module names: transformers' ``tp_plan`` (5.x), else a
    ``_tp_plan`` attribute (transformers 4.x, or a plain module that carries one)."""
    for attr in ("tp_plan", "_tp_plan"):
        try:
            plan = getattr(model, attr, None)
        except Exception:  # noqa: BLE001 - a property that needs a distributed set-up to answer
            plan = None
        if isinstance(plan, Mapping) and plan:
            return plan
    return None


def build_tp_plan(model: nn.Module, config: ShardConfig) -> TPPlan | None:
    """The validated plan, or None without tensor parallelism (``tp_size`` 1). Raises
    :class:`ShardConfigError` naming the key, the value and the fix for: a model without a plan
    under ``tp_plan: auto``; a style shardcore does not apply; a pattern that matches no module; a
    style on a module of the wrong kind; a split dim (features, vocabulary, attention heads) that
    ``tp_size`` does not divide; tied weights split two ways; a PEFT model."""
    if config.tp_size == 1:
        return None
    size = config.tp_size
    from .integrations import peft

    if peft.is_peft_model(model):
        raise ShardConfigError(
            "tp_size",
            f"is {size} but {type(model).__name__} is a PEFT model. shardcore does not split LoRA adapters across "
            "tensor-parallel ranks yet (PEFT's own rules for it need transformers' TP loading, "
            "from_pretrained(tp_plan=...)). Train LoRA with tp_size 1 (FSDP and HSDP shard it).",
        )
    if config.tp_plan in (None, "auto"):
        patterns, source = model_tp_plan(model), "the model's tp_plan"
        if patterns is None:
            raise ShardConfigError(
                "tp_plan",
                f"is 'auto' (tp_size {size}) but {type(model).__name__} carries no tensor-parallel plan (no tp_plan or "
                "_tp_plan, no config.base_model_tp_plan). Give tp_plan as a mapping of module-name pattern -> style, "
                'such as {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}.',
            )
        for pattern, style in patterns.items():
            check_tp_style("tp_plan", style, f"{type(model).__name__}'s own pattern {pattern!r} (tp_plan: auto)")
    else:
        patterns, source = config.tp_plan, "tp_plan"
    key = "tp_plan"
    modules = dict(model.named_modules())
    compiled = [(p, pattern_regex(p), s) for p, s in patterns.items()]
    styles: list[tuple[str, str]] = []
    matched = {p: 0 for p in patterns}
    for name, module in modules.items():
        hits = [(p, s) for p, rx, s in compiled if name and rx.match(name)]
        if not hits:
            continue
        if len({s for _, s in hits}) > 1:
            raise ShardConfigError(
                key, f"gives module {name!r} two styles ({hits}). Make the patterns of {source} name it once."
            )
        for p, _ in hits:
            matched[p] += 1
        style = hits[0][1]
        _check_module(key, name, module, style, size)
        styles.append((name, style))
    unmatched = [p for p, n in matched.items() if n == 0]
    if unmatched:
        raise ShardConfigError(
            key,
            f"pattern {unmatched[0]!r} of {source} matches no module of {type(model).__name__}. Patterns are module "
            f"names with * for a layer number, such as {_example(modules)!r}. Fix or remove it.",
        )
    _check_heads(model, size, source)
    plan = TPPlan(size, tuple(styles), source)
    _check_ties(model, plan)
    return plan


def _example(modules: Mapping[str, nn.Module]) -> str:
    linear = next((n for n, m in modules.items() if isinstance(m, nn.Linear)), next(iter(modules)))
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), linear)


def _check_module(key: str, name: str, module: nn.Module, style: str, size: int) -> None:
    kind, dim = _SPLITS[style]
    if not isinstance(module, kind):
        raise ShardConfigError(
            key,
            f"gives {name} ({type(module).__name__}) the style {style!r}, which splits {kind.__name__} layers only. "
            f"Give it a style for a {type(module).__name__}, or leave it out of the plan.",
        )
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        raise ShardConfigError(key, f"gives {name} the style {style!r}, but it has no 2-D weight to split.")
    # Linear weights are (out, in), Embedding weights (rows, columns)
    what = {
        (nn.Linear, 0): "output features",
        (nn.Linear, 1): "input features",
        (nn.Embedding, 0): "rows (vocabulary)",
        (nn.Embedding, 1): "columns",
    }[(kind, dim)]
    n = weight.shape[dim]
    if n % size:
        raise ShardConfigError(
            "tp_size",
            f"is {size}, which does not divide the {n} {what} of {name} ({style}). Use a tp_size that divides {n}, "
            "or leave the module out of tp_plan.",
        )


def _check_heads(model: nn.Module, size: int, source: str) -> None:
    """Attention reshapes its projections into heads; a tp rank holding part of a head computes
    nonsense without an error (transformers 5.x accepts uneven splits), so whole heads per rank."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for attr in _HEAD_COUNTS:
        n = getattr(config, attr, None)
        if isinstance(n, int) and n % size:
            raise ShardConfigError(
                "tp_size",
                f"is {size}, which does not divide the model's {attr} ({n}): each tensor-parallel rank must hold whole "
                f"attention heads. Use a tp_size that divides {n}.",
            )


def _check_ties(model: nn.Module, plan: TPPlan) -> None:
    """A tied weight (input embedding and output head) is one tensor: every holder must split it
    along the same dim, or not at all."""
    dims = plan.split_dims()
    for group in tie_groups(model):
        seen = {site.name: dims.get(site.name) for site in group}
        if len(set(seen.values())) > 1:
            shown = ", ".join(f"{n}: {'whole' if d is None else f'dim {d}'}" for n, d in seen.items())
            raise ShardConfigError(
                "tp_plan",
                f"splits the tied weight {group[0].name} two ways ({shown}). Tied weights are one tensor: give its "
                f"holders styles that split the same dim (embedding_rowwise with colwise), or untie them "
                f"(tie_word_embeddings=False). Plan from {plan.source}: {show_value(plan.as_dict())}.",
            )
