"""Compare a sharded run with the single-device reference. Tolerances live here and nowhere else."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    loss_atol: float
    loss_rtol: float
    grad_norm_rtol: float
    param_atol: float


# fp32: sharding changes only the order of floating-point reductions (reduce-scatter vs. one local
# sum), which moves results by a few ulps per step (measured on 2 gloo ranks, 5 AdamW steps at lr
# 1e-2: losses 4.8e-7, parameters 1.7e-6). bf16: the reference computes in bf16 too, but gradients
# are summed in another order and rounded to 8 mantissa bits; with AdamW at lr 1e-3 the worst
# parameter moved 2.1e-3 in 5 steps.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(loss_atol=1e-6, loss_rtol=1e-6, grad_norm_rtol=1e-5, param_atol=1e-5),
    "bf16": Tolerance(loss_atol=1e-2, loss_rtol=1e-3, grad_norm_rtol=1e-2, param_atol=1e-2),
}


@dataclass
class Verdict:
    case: str
    ok: bool
    reasons: list[str] = field(default_factory=list)
    max_loss_diff: float = math.nan
    max_grad_norm_rel_diff: float = math.nan
    max_param_diff: float = math.nan
    tolerance: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(case: str, ref: dict[str, Any], got: dict[str, Any], dtype: str = "fp32") -> Verdict:
    tol = TOLERANCES[dtype]
    v = Verdict(case, True, tolerance=asdict(tol))
    for side, r in (("reference", ref), ("sharded", got)):
        if "error" in r:
            v.ok = False
            v.reasons.append(f"{side} run failed: {r['error'].splitlines()[0]}")
    if not v.ok:
        return v
    rl, gl = ref["losses"], got["losses"]
    if len(rl) != len(gl):
        v.ok = False
        v.reasons.append(f"step count differs: reference {len(rl)}, sharded {len(gl)}")
        return v
    v.max_loss_diff = max(abs(a - b) for a, b in zip(rl, gl))
    for i, (a, b) in enumerate(zip(rl, gl)):
        if not abs(a - b) <= tol.loss_atol + tol.loss_rtol * abs(a):
            v.ok = False
            v.reasons.append(f"loss differs at step {i}: reference {a:.9g}, sharded {b:.9g} (|diff| {abs(a - b):.3g})")
            break
    rels = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref["grad_norms"], got["grad_norms"])]
    v.max_grad_norm_rel_diff = max(rels) if rels else 0.0
    for i, rel in enumerate(rels):
        if not rel <= tol.grad_norm_rtol:
            v.ok = False
            v.reasons.append(
                f"gradient norm differs at step {i}: reference {ref['grad_norms'][i]:.9g}, sharded "
                f"{got['grad_norms'][i]:.9g} (relative {rel:.3g}); are gradients averaged across ranks?"
            )
            break
    rp, gp = ref["params"], got["params"]
    missing, extra = sorted(set(rp) - set(gp)), sorted(set(gp) - set(rp))
    if missing or extra:
        v.ok = False
        v.reasons.append(f"final state dict keys differ: missing {missing[:5]}, extra {extra[:5]}")
        return v
    worst, worst_key = 0.0, None
    for k in rp:
        if rp[k].shape != gp[k].shape:
            v.ok = False
            v.reasons.append(f"parameter {k} has shape {tuple(gp[k].shape)}, reference {tuple(rp[k].shape)}")
            return v
        d = float((rp[k].float() - gp[k].float()).abs().max()) if rp[k].numel() else 0.0
        if not d <= worst:  # also catches NaN
            worst, worst_key = d, k
    v.max_param_diff = worst
    if not worst <= tol.param_atol:
        v.ok = False
        v.reasons.append(f"final parameter {worst_key} differs by {worst:.3g} (tolerance {tol.param_atol:g})")
    return v

