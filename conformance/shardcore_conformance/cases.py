"""Conformance cases: a model, a config and a short training schedule, all deterministic."""
from __future__ import annotations

import fnmatch
import itertools
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    config: dict[str, Any] = field(default_factory=dict)
    steps: int = 5
    global_batch: int = 8
    seed: int = 0
    lr: float = 1e-2
    dtype: str = "fp32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Case":
        return cls(**d)


_WRAP = {
    "mlp": {
        "transformer": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
        "size": {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 500},
        "nowrap": {"auto_wrap_policy": "NO_WRAP"},
    },
    "llama": {
        "transformer": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
        "size": {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000},
        "nowrap": {"auto_wrap_policy": "NO_WRAP"},
    },
}


def fsdp2_matrix() -> list[Case]:
    """Every model x wrap policy x reshard_after_forward x activation_checkpointing, plus cpu_offload
    and mixed precision on each model."""
    cases = []
    for model, wrap, reshard, ac in itertools.product(("mlp", "llama"), ("transformer", "size", "nowrap"), (True, False), (False, True)):
        if ac and wrap == "nowrap":
            continue  # activation checkpointing needs units to checkpoint; NO_WRAP has none
        cfg = dict(_WRAP[model][wrap], reshard_after_forward=reshard, activation_checkpointing=ac)
        name = f"{model}-{wrap}-reshard{int(reshard)}-ac{int(ac)}"
        cases.append(Case(name, model, cfg))
    for model in ("mlp", "llama"):
        cases.append(Case(f"{model}-cpu_offload", model, {"cpu_offload": True}))
        # low-precision cases train at a lower lr: AdamW turns a bf16-rounded gradient of the wrong
        # sign into a full-size step, so the parameter drift per step scales with lr
        cases.append(Case(f"{model}-mp-bf16", model, {"mixed_precision": "bf16"}, dtype="bf16", lr=1e-3))
    cases.append(Case("llama-mp-bf16-reduce-fp32", "llama",
                      {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}, dtype="bf16", lr=1e-3))
    return cases


def select(cases: list[Case], pattern: str | None) -> list[Case]:
    if not pattern:
        return cases
    pats = [p.strip() for p in pattern.split(",") if p.strip()]
    return [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in pats)]
