"""Compare a sharded run with the single-device reference. Tolerances live here and nowhere else."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    """``loss_atol + loss_rtol * |reference loss|`` per step; ``grad_norm_rtol`` relative per step;
    ``param_atol`` on every final parameter and buffer entry; ``output_atol`` on the outputs (logits)
    of a fresh single-device model loaded from the sharded run's checkpoint, against the trained
    reference's. A checkpoint must hold exactly the sharded model's state: ``checkpoint_atol`` 0."""

    loss_atol: float
    loss_rtol: float
    grad_norm_rtol: float
    param_atol: float
    output_atol: float
    checkpoint_atol: float = 0.0


# fp32: sharding changes only the order of floating-point reductions (reduce-scatter vs. one local
# sum), and so do the machine's kernels (eager ATen's AVX2 or AVX-512 code, oneDNN/MKL blocking) and
# XLA:CPU's compiled code. What AdamW passes on of the difference in a gradient entry between any
# two correct implementations is at most GRADIENT_ROUNDING (measured, tests/test_numerics.py), so
# AdamW's eps (train.ADAM_EPS) bounds one step's parameter difference from rounding by
# lr * GRADIENT_ROUNDING / eps = 2.5e-5, half of param_atol. Measured with it (2026-12-03, the whole
# matrix, native AVX2 and capped to SSE4.2, eager and XLA alike; docs/numerics.md): FSDP2 on 2 gloo ranks and XLA (both
# modes, 1/2/4 CPU devices) against eager CPU: parameters <= 9e-6, losses <= 1.4e-6, gradient norms
# <= 1.1e-6 relative, checkpoint outputs (logits) <= 1.2e-5 — all several times inside the bounds,
# which a sharding bug exceeds by orders of magnitude (>= 1e-3 in the broken backends).
# bf16: the reference computes in bf16 too, but gradients are summed in another order and
# rounded to 8 mantissa bits; with AdamW at lr 1e-3: losses 2.3e-3, parameters 2.0e-3, outputs 2.2e-3.
#: the most AdamW passes on of one gradient entry's difference between two correct fp32
#: implementations of one step on the conformance models, in gradient units: eps / lr x one step's
#: parameter difference, which is the whole difference on entries below eps (where AdamW's gain
#: lr / eps acts) and eps^2 / g^2 of it on larger ones (whose step is sign-like). Eager CPU vs one
#: XLA:CPU device, each at AVX-512, AVX2 and SSE4.2 (2026-12-04, an AVX-512 AMD EPYC): 3.8e-8 on
#: GPT-2, 2.0e-8 on the MLP, 4.4e-9 on Llama. The raw difference is larger where it does not matter:
#: 2.53e-7 on an MLP head entry of 0.18 (AVX-512 vs SSE4.2 eager; 17 ulps, sums over the batch in
#: another order), where AdamW's step differs by 8e-12.
GRADIENT_ROUNDING = 2.5e-7

TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(loss_atol=1e-6, loss_rtol=1e-6, grad_norm_rtol=1e-5, param_atol=5e-5, output_atol=5e-5),
    "bf16": Tolerance(loss_atol=1e-2, loss_rtol=1e-3, grad_norm_rtol=1e-2, param_atol=1e-2, output_atol=5e-2),
}


@dataclass
class Verdict:
    case: str
    ok: bool
    reasons: list[str] = field(default_factory=list)
    max_loss_diff: float = math.nan
    max_grad_norm_rel_diff: float = math.nan
    max_param_diff: float = math.nan
    max_output_diff: float = math.nan
    checkpoint_param_diff: float = math.nan
    checkpoint_method: str = ""
    tolerance: dict[str, float] = field(default_factory=dict)
    #: per kind: the expected count and bytes per optimizer step (None: not predicted for this
    #: backend) and rank 0's observed ones in its first step; ``comm_checked`` whether they were checked
    comm: dict[str, Any] = field(default_factory=dict)
    comm_checked: bool = False
    #: the backend's ``communication_pattern`` ("" if it declares none)
    comm_pattern: str = ""
    #: graphs dynamo compiled in each optimizer step of the sharded run
    compiled_graphs: list[int] = field(default_factory=list)
    #: check -> the keys of this case whose effect it observed (:mod:`.evidence` adds them up)
    observed: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fail(v: Verdict, reason: str) -> None:
    v.ok = False
    v.reasons.append(reason)


def _observed(v: Verdict, check: str, keys: Any, config: Any) -> None:
    """``check`` saw the effect of those of ``keys`` that the case's parsed ``config`` sets."""
    seen = sorted(set(keys) & set(config.non_default_keys()))
    if seen:
        v.observed.setdefault(check, [])
        v.observed[check] = sorted(set(v.observed[check]) | set(seen))


def compare(
    case: str,
    ref: dict[str, Any],
    got: dict[str, Any],
    dtype: str = "fp32",
    config: dict[str, Any] | None = None,
    grad_accum: int = 1,
) -> Verdict:
    """Per-step losses, gradient norms and learning rates; final parameters and buffers (frozen ones
    exactly); where the sharded run reports one, its checkpoint round trip; and with the case's
    ``config``, each step's collectives on every rank (:mod:`.comm`) and, under ``torch_compile``,
    that the units were compiled once, in the first step."""
    tol = TOLERANCES[dtype]
    v = Verdict(case, True, tolerance=asdict(tol))
    for side, r in (("reference", ref), ("sharded", got)):
        if "error" in r:
            _fail(v, f"{side} run failed: {r['error'].splitlines()[0]}")
    if not v.ok:
        return v
    rl, gl = ref["losses"], got["losses"]
    if len(rl) != len(gl):
        _fail(v, f"step count differs: reference {len(rl)}, sharded {len(gl)}")
        return v
    v.max_loss_diff = max((abs(a - b) for a, b in zip(rl, gl)), default=0.0)
    numbers_from = len(v.reasons)
    first_loss = None
    for i, (a, b) in enumerate(zip(rl, gl)):
        if not abs(a - b) <= tol.loss_atol + tol.loss_rtol * abs(a):
            first_loss = i
            _fail(v, f"loss differs at step {i}: reference {a:.9g}, sharded {b:.9g} (|diff| {abs(a - b):.3g})")
            break
    rels = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref["grad_norms"], got["grad_norms"])]
    v.max_grad_norm_rel_diff = max(rels) if rels else 0.0
    for i, rel in enumerate(rels):
        if not rel <= tol.grad_norm_rtol:
            _fail(
                v,
                f"gradient norm differs at step {i}: reference {ref['grad_norms'][i]:.9g}, sharded "
                f"{got['grad_norms'][i]:.9g} (relative {rel:.3g}); are gradients averaged across ranks?",
            )
            break
    for i, (a, b) in enumerate(zip(ref.get("clip_norms", []), got.get("clip_norms", []))):
        rel = abs(a - b) / max(abs(a), 1e-12)
        if not rel <= tol.grad_norm_rtol:
            _fail(
                v,
                f"clipping norm differs at step {i}: reference {a:.9g}, sharded {b:.9g} (relative {rel:.3g}); "
                "is the norm computed over every rank's shards?",
            )
            break
    if len(ref.get("clip_norms", [])) != len(got.get("clip_norms", [])):
        _fail(
            v,
            f"clipping norms: reference reported {len(ref.get('clip_norms', []))}, sharded {len(got.get('clip_norms', []))}",
        )
    for i, (a, b) in enumerate(zip(ref.get("lrs", []), got.get("lrs", []))):
        if not math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0):
            _fail(
                v,
                f"learning rate differs at step {i}: reference {a:.9g}, sharded {b:.9g}; the schedule must see the same optimizer steps",
            )
            break
    rp, gp = ref["params"], got["params"]
    missing, extra = sorted(set(rp) - set(gp)), sorted(set(gp) - set(rp))
    if missing or extra:
        _fail(v, f"final state dict keys differ: missing {missing[:5]}, extra {extra[:5]}")
        return v
    worst, worst_key = 0.0, None
    for k in rp:
        if rp[k].shape != gp[k].shape:
            _fail(v, f"parameter {k} has shape {tuple(gp[k].shape)}, reference {tuple(rp[k].shape)}")
            return v
        d = _max_abs(rp[k], gp[k])
        if not math.isnan(worst) and not d <= worst:  # a NaN, once seen, stays the worst
            worst, worst_key = d, k
    v.max_param_diff = worst
    if not worst <= tol.param_atol:
        _fail(v, f"final parameter {worst_key} differs by {worst:.3g} (tolerance {tol.param_atol:g})")
    resumed = got.get("resumed_at")
    if resumed and len(v.reasons) > numbers_from and (first_loss is None or first_loss >= resumed):
        v.reasons.insert(
            numbers_from,
            f"resuming diverged: the sharded run saved its model and optimizer after {resumed} steps and trained "
            f"on from a new model and optimizer that loaded them, and it differs from the uninterrupted run "
            f"({v.reasons[numbers_from]}); does the checkpoint hold the optimizer state, and does load restore it?",
        )
    elif got.get("other_weights") and first_loss == 0:
        v.reasons.insert(
            numbers_from,
            "cpu_ram_efficient_loading is set, so rank 0's weights are the ones sharded, but the run trained from "
            f"the other ranks' own weights ({v.reasons[numbers_from]})",
        )
    for k in ref.get("frozen", []):
        d = _max_abs(rp[k], gp[k])
        if not d == 0.0:
            _fail(
                v,
                f"frozen parameter {k} (requires_grad=False) changed: differs from the reference by {d:.3g}; it must not be updated",
            )
            break
    ck = got.get("checkpoint")
    if ck is not None:
        _compare_checkpoint(v, tol, ref, ck)
    if config is not None:
        from shardcore import parse_config

        cfg = parse_config(config)
        _compare_communication(v, ref, got, cfg, grad_accum)
        _compare_compilation(v, got, cfg)
        _compare_placement(v, got, cfg)
        _compare_tp_split(v, ref, got, cfg)
        _compare_effects(v, ref, got, cfg)
        _observe_other_checks(v, got, cfg)
    return v


def _compare_effects(v: Verdict, ref: dict[str, Any], got: dict[str, Any], cfg: Any) -> None:
    """What the modules did in the first step (:mod:`.effects`): recomputation and compute dtype;
    and the process group's timeout."""
    from .effects import (
        RECOMPUTATION_KEYS,
        compute_dtype_name,
        dtype_problems,
        recomputation_problems,
        recomputing_key,
    )

    if "modules" in ref and got.get("modules"):
        units = [u["path"] for u in ref.get("units", []) if u["path"]]
        for problem in recomputation_problems(ref["modules"], got["modules"], units, cfg):
            _fail(v, problem)
        _observed(v, "recomputation", RECOMPUTATION_KEYS, cfg)
        if recomputing_key(cfg) is not None:  # which modules recompute is which modules are units
            _observed(v, "recomputation", WRAP_KEYS, cfg)
        compute = compute_dtype_name(cfg)
        # XLA's compute_dtype is held to its all-gather bytes (communication), not to this check:
        # torch_xla 2.9's XLA FSDP puts the gathered bf16 data into parameters that still say float32
        # (_replace_xla_tensor keeps the dtype), so every op that promotes by the declared dtype (a norm's
        # weight * x, and each Linear after it) computes in float32 (conformance/README.md, "Compute dtype
        # under XLA FSDP").
        if not dict(cfg.xla_fsdp_settings).get("compute_dtype"):
            for problem in dtype_problems(ref["modules"], got["modules"], compute):
                _fail(v, problem)
            if compute is not None:
                _observed(v, "compute dtype", ("mixed_precision",), cfg)
    writes = got.get("async_save")
    if writes is not None and cfg.async_save:
        early = [r for r, w in enumerate(writes) if w["on_caller"]]
        if early:
            _fail(
                v,
                f"background save differs: async_save is set, but rank(s) {early} wrote the model's checkpoint files "
                "before save() returned; the training loop waited for the write",
            )
        elif not any(w["in_background"] for w in writes):
            _fail(v, "background save differs: async_save is set, but no rank was seen writing the model's files")
        _observed(v, "background save", ("async_save",), cfg)
    timeout = got.get("timeout")
    if timeout is not None and "timeout" in cfg.non_default_keys():
        if timeout != cfg.timeout:
            _fail(
                v,
                f"timeout differs: the process group's timeout is {timeout:g}s, the config's 'timeout' is "
                f"{cfg.timeout:g}s; a peer that stops would be waited for that long",
            )
        _observed(v, "process-group timeout", ("timeout",), cfg)


#: the keys that decide the units
WRAP_KEYS = ("auto_wrap_policy", "min_num_params", "transformer_layer_cls_to_wrap")
#: per communication pattern, the keys whose effect the check against its prediction sees
TP_KEYS = ("tp_size", "tp_plan")
COMMUNICATION_KEYS = {
    "fsdp": (
        "reshard_after_forward",
        *WRAP_KEYS,
        "mixed_precision",
        "dp_replicate_size",
        "dp_shard_size",
        "tp_size",
        "tp_plan",
    ),
    "xla_fsdp": ("reshard_after_forward", *WRAP_KEYS, "xla_fsdp_settings"),  # gathers in the compute dtype
    "spmd": ("dp_replicate_size", "dp_shard_size"),
}


def _observe_other_checks(v: Verdict, got: dict[str, Any], cfg: Any) -> None:
    """The keys whose effect the numbers, the placement, the compilation or a resumed run show."""
    if got.get("resumed_at"):
        _observed(v, "resume", ("state_dict_type",), cfg)
    if got.get("other_weights"):  # ranks but 0 started from other weights: only rank 0's may be trained
        _observed(v, "rank 0's weights", ("cpu_ram_efficient_loading",), cfg)
    if cfg.dp_replicate_size and cfg.dp_replicate_size > 1:  # every replica trains on its own rows
        _observed(v, "numbers", ("dp_replicate_size", "dp_shard_size"), cfg)
    placement = got.get("placement") or {}
    requested = placement.get("requested")
    if requested:
        keys = ["xla"] if requested == "xla" else []
        if requested != "cpu":
            keys += ["cpu_offload", "use_cpu"]
        if placement.get("devices", 1) > 1:
            keys.append("xla_fsdp_v2")  # SPMD splits one global batch over the devices
        _observed(v, "placement", keys, cfg)
    if v.compiled_graphs:
        _observed(v, "compilation", ("torch_compile",), cfg)


def _compare_communication(v: Verdict, ref: dict[str, Any], got: dict[str, Any], cfg: Any, a: int) -> None:
    from .comm import KINDS, check, predictions

    comm = got.get("comm")
    if comm:
        v.comm_pattern = comm.get("pattern") or ""
    if not comm or not comm["ranks"] or not comm["ranks"][0]:
        return
    first = comm["ranks"][0][0]
    expected = None
    predict = predictions().get(comm.get("pattern"))
    if predict is not None and "units" in ref:
        expected = predict(ref["units"], cfg, comm["world_size"], a)
    if expected is not None:
        v.comm_checked = True
        for problem in check(comm["ranks"], expected)[:1]:
            _fail(v, problem)
        if comm["world_size"] > 1:  # a collective over one rank moves nothing and is not counted
            keys = COMMUNICATION_KEYS.get(comm.get("pattern"), ())
            if cfg.torch_compile:  # TP's collectives run inside the compiled graphs, uncounted
                keys = tuple(k for k in keys if k not in TP_KEYS)
            _observed(v, "communication", keys, cfg)
    v.comm = {
        k: {
            "count": first[k]["count"],
            "bytes": first[k]["bytes"],
            "expected_count": expected[k]["count"] if isinstance(expected, dict) else None,
            "expected_bytes": expected[k]["bytes"] if isinstance(expected, dict) else None,
        }
        for k in KINDS
    }


def _compare_placement(v: Verdict, got: dict[str, Any], cfg: Any) -> None:
    from .hardware import placement_problems

    placement = got.get("placement")
    if placement:
        # from the config, not from the backend: a backend that ignores xla_fsdp_v2 feeds each device its own rows
        spmd = got.get("comm", {}).get("pattern") == "spmd" or cfg.xla_fsdp_v2
        for problem in placement_problems(placement, cfg, spmd):
            _fail(v, problem)


def _compare_tp_split(v: Verdict, ref: dict[str, Any], got: dict[str, Any], cfg: Any) -> None:
    """With ``tp_size`` > 1, every parameter on every rank is split along the dim the plan says on
    the mesh dim named ``"tp"`` (torchtitan's and accelerate's name), and the others are not split
    there. The plan's dims come from the reference's plan of the same model and config."""
    if cfg.tp_size == 1 or "units" not in ref:
        return
    want = {n: d for u in ref["units"] for n, d in u.get("tp_split", {}).items()}
    for rank, p in enumerate((got.get("placement") or {}).get("ranks", [])):
        have = p.get("tp_split") or {}
        for name in sorted(set(want) | set(have)):
            w, h = want.get(name), have.get(name)
            if w != h:

                def said(d: int | None) -> str:
                    return "not split" if d is None else f"split along dim {d}"

                _fail(
                    v,
                    f"tensor parallelism: rank {rank}'s {name} is {said(h)} over the tp mesh dim; the plan "
                    f"(tp_size {cfg.tp_size}) has it {said(w)}",
                )
                return
    _observed(v, "placement", ("tp_size", "tp_plan"), cfg)


def _compare_compilation(v: Verdict, got: dict[str, Any], cfg: Any) -> None:
    graphs = got.get("compile", {}).get("graphs_per_step", [])
    v.compiled_graphs = list(graphs)
    if not cfg.torch_compile or not graphs:
        return
    if graphs[0] == 0:
        _fail(v, "torch_compile is set but dynamo compiled no graph in the first step: the units ran eagerly")
    fresh = {0, got.get("resumed_at") or 0}  # a resumed run compiles its new model again
    later = [(i, n) for i, n in enumerate(graphs) if i not in fresh and n]
    if later:
        i, n = later[0]
        _fail(v, f"recompiled after the first optimizer step: {n} new graph(s) in step {i} (torch_compile)")


def _compare_checkpoint(v: Verdict, tol: Tolerance, ref: dict[str, Any], ck: dict[str, Any]) -> None:
    v.checkpoint_method = ck.get("method", "")
    diffs = [d for d in (ck.get("fresh_param_diff"), ck.get("reload_param_diff")) if d is not None]
    v.checkpoint_param_diff = max(diffs) if diffs else math.nan
    fresh, reload = ck.get("fresh_param_diff"), ck.get("reload_param_diff")
    if fresh is not None and not fresh <= tol.checkpoint_atol:
        _fail(
            v,
            f"checkpoint round trip ({v.checkpoint_method}): a fresh single-device model loaded from the FULL "
            f"checkpoint differs from the sharded model's full state dict by {fresh:.3g}",
        )
    if reload is not None and not reload <= tol.checkpoint_atol:
        _fail(
            v,
            f"checkpoint round trip ({v.checkpoint_method}): the sharded model loaded from its own checkpoint "
            f"differs from its state before saving by {reload:.3g}",
        )
    if "probe" not in ref:
        return
    loaded = {
        "probe": "the model loaded from the checkpoint",
        # a PEFT model's FULL checkpoint, as PEFT and Transformers users load it
        "peft_probe": "PeftModel.from_pretrained(base, adapter directory)",
        "merged_probe": "AutoModelForCausalLM.from_pretrained(merged export)",
    }
    for key, what in loaded.items():
        if key not in ck:
            continue
        a, b = ref["probe"], ck[key]
        if tuple(a.shape) != tuple(b.shape):
            _fail(
                v, f"checkpoint round trip: outputs of {what} have shape {tuple(b.shape)}, reference {tuple(a.shape)}"
            )
            continue
        d = _max_abs(a, b)
        v.max_output_diff = d if math.isnan(v.max_output_diff) else max(v.max_output_diff, d)
        if not d <= tol.output_atol:
            _fail(
                v,
                f"checkpoint round trip: outputs of {what} differ from the reference's by {d:.3g} "
                f"(tolerance {tol.output_atol:g})",
            )


def _max_abs(a, b) -> float:
    if not a.numel():
        return 0.0
    return float((a.double() - b.double()).abs().max())
