"""The conformance report: ``report.json`` (every case, its numbers and verdict), ``report.md`` (the
tables a person reads) and PNG plots of the loss curves, sharded over reference, with the per-step
difference against its tolerance (``plots/loss-<family>.png``, one figure per case family)."""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cases import Case, covered_keys
from .compare import TOLERANCES, Verdict
from .evidence import markdown as evidence_markdown
from .hardware import versions

if TYPE_CHECKING:
    from .suite import SuiteResult

log = logging.getLogger(__name__)

_STATS = ("max_loss_diff", "max_grad_norm_rel_diff", "max_param_diff", "max_output_diff")


def _finite_or_none(x: Any) -> Any:
    """JSON has no NaN/inf: a number that is not finite is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x


def family_summary(result: "SuiteResult", cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Per case family: how many cases, how many passed, and the largest of each measured diff."""
    fam = {c.name: c.family for c in cases}
    out: dict[str, dict[str, Any]] = {}
    for v in result.verdicts:
        s = out.setdefault(fam[v.case], {"cases": 0, "passed": 0, **{k: math.nan for k in _STATS}})
        s["cases"] += 1
        s["passed"] += int(v.ok)
        for k in _STATS:
            x = getattr(v, k)
            if math.isfinite(x) and not x <= s[k]:  # NaN-initialised max
                s[k] = x
    return out


def _case_row(v: Verdict, c: Case, ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    ranks = got.get("placement", {}).get("ranks") or [{}]
    return {
        **v.to_dict(),
        # rank 0: where its batch, loss, parameters and gradients lived (XLA: the batch's sharding)
        "placement": {k: w for k, w in ranks[0].items() if k != "hardware"},
        "family": c.family,
        "model": c.model,
        "config": c.config,
        "dtype": c.dtype,
        "steps": c.steps,
        "global_batch": c.global_batch,
        "grad_accum": c.grad_accum,
        "resume_at": c.resume_at,
        # a LoRA case's FULL checkpoint (the adapter) against its merged export, in bytes
        "checkpoint_bytes": {
            k: v for k, v in (got.get("checkpoint") or {}).items() if k in ("adapter_bytes", "merged_bytes")
        },
        "lr": c.lr,
        "lr_schedule": c.lr_schedule,
        "frozen": list(c.frozen),
        "reference_losses": ref.get("losses"),
        "sharded_losses": got.get("losses"),
        "reference_grad_norms": ref.get("grad_norms"),
        "sharded_grad_norms": got.get("grad_norms"),
        "max_grad_norm": c.max_grad_norm,
        "norm_type": c.norm_type,
        "reference_clip_norms": ref.get("clip_norms"),
        "sharded_clip_norms": got.get("clip_norms"),
        "lrs": ref.get("lrs"),
        "frozen_params": ref.get("frozen", []),
        "reference_error": ref.get("error"),
        "sharded_error": got.get("error"),
    }


def write_report(result: "SuiteResult", cases: list[Case], out: Path, plots: bool = True) -> list[Path]:
    """Write report.json, report.md and (``plots``, with matplotlib) the PNGs into ``out``; returns
    the files written."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    by_name = {c.name: c for c in cases}
    rows = [_case_row(v, by_name[v.case], result.reference[v.case], result.sharded[v.case]) for v in result.verdicts]
    coverage = covered_keys(cases)
    supported = sorted(result.supported_keys)
    uncovered = [k for k in supported if k not in coverage]
    families = family_summary(result, cases)
    plot_files = _plots(result, cases, out) if plots else []
    passed = sum(v.ok for v in result.verdicts)
    xfail = lambda vs: [
        {"case": v.case, "expected_because": result.expected_failures[v.case], "reasons": v.reasons} for v in vs
    ]  # noqa: E731
    doc = {
        "backend": result.backend,
        "world_size": result.world_size,
        "device_type": result.device_type,
        "headline": result.headline(),
        "hardware": result.hardware(),
        "devices": result.placement().get("devices"),
        "versions": versions(),
        "pjrt_device": os.environ.get("PJRT_DEVICE") if result.device_type == "xla" else None,
        "ok": result.ok,
        "passed": passed,
        "failed": len(result.failures()),
        "expected_failures": xfail(result.expected()),
        "unexpected_passes": xfail(result.unexpected_passes()),
        "seconds": round(result.seconds, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tolerances": {k: vars(t) for k, t in TOLERANCES.items()},
        "supported_keys": supported,
        "covered_keys": coverage,
        "uncovered_keys": uncovered,
        "evidence": result.evidence(),
        "families": families,
        "plots": [str(p.relative_to(out)) for p in plot_files],
        "cases": rows,
    }
    (out / "report.json").write_text(json.dumps(_finite_or_none(doc), indent=2, default=float))
    (out / "report.md").write_text(_markdown(result, families, coverage, uncovered, plot_files, out))
    log.info("report written to %s", out)
    return [out / "report.json", out / "report.md", *plot_files]


def _hardware_section(result: "SuiteResult") -> list[str]:
    """What this report certifies: the device type requested, each rank's device, the software."""
    p = result.placement()
    lines = [
        "## Hardware",
        "",
        f"Device type requested: `{result.device_type}`; world size {result.world_size}"
        + (f", {p['devices']} devices" if p.get("devices") and p["devices"] != result.world_size else "")
        + ". Every case checked that its batches, loss, parameters and gradients lived on it.",
        "",
        "| rank | type | index | name | runtime |",
        "|---|---|---|---|---|",
    ]
    for rank, h in enumerate(result.hardware()):
        lines.append(
            f"| {rank} | {h.get('type', '?')} | {'' if h.get('index') is None else h['index']} | {h.get('name', '?')} "
            f"| {h.get('runtime', '')} |"
        )
    pjrt = {"PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "unset")} if result.device_type == "xla" else {}
    software = {**versions(), **pjrt}
    lines += ["", "Software: " + ", ".join(f"{k} {v}" for k, v in software.items()), ""]
    return lines


def _communication_table(result: "SuiteResult") -> list[str]:
    """Per case: rank 0's collectives in its first optimizer step, observed (expected where the
    backend's pattern is predicted), and the graphs dynamo compiled per step."""
    rows = [v for v in result.verdicts if v.comm]
    if not rows:
        return []
    lines = [
        "",
        "## Communication (rank 0, first optimizer step; every rank and step is checked)",
        "",
        "Calls and bytes of the full-size tensors (gathered output, unreduced input, all-reduced tensor). "
        "`6 (5)`: observed 6, predicted 5 from the wrap plan and the config; no parentheses: as predicted, "
        "or not predicted for this backend (checked: no).",
    ]
    if any(v.comm_pattern == "spmd" for v in rows):
        lines += [
            "",
            "SPMD: the collectives of the program as XLA partitioned it, for every device. Which tensors the "
            "partitioner gathers and how it fuses or splits reductions is its choice, so counts are not "
            "predicted; checked: parameters all-gathered along `fsdp`, gradients summed over the shards (and "
            "across replicas under HSDP), every collective along an axis of the mesh.",
        ]
    lines += [
        "",
        "| case | checked | all-gathers | all-gather bytes | reduce-scatters | reduce-scatter bytes | all-reduces | all-reduce bytes | compiled graphs per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in rows:
        cells = []
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            c = v.comm[kind]
            n, want = c["count"], c["expected_count"]
            cells.append(f"{n}" + (f" ({want})" if want is not None and want != n else ""))
            lo, hi = c["expected_bytes"] or (None, None)
            off = lo is not None and not lo <= c["bytes"] <= hi
            cells.append(f"{c['bytes']:,}" + (f" ({lo:,}-{hi:,})" if off else ""))
        graphs = ", ".join(str(g) for g in v.compiled_graphs) if any(v.compiled_graphs) else "-"
        lines.append(f"| {v.case} | {'yes' if v.comm_checked else 'no'} | " + " | ".join(cells) + f" | {graphs} |")
    return lines


def _g(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.3g}"


def _markdown(result, families, coverage, uncovered, plot_files, out: Path) -> str:
    expected = f", {len(result.expected())} expected failures" if result.expected() else ""
    lines = [
        f"# shardcore conformance: {result.headline()}",
        "",
        f"**{'PASS' if result.ok else 'FAIL'}**: {result.headline(expected)}, in {result.seconds:.0f}s.",
        "",
        "## Evidence",
        "",
        "What this run proved of each key the backend supports: the checks that observed its effect, or why "
        "none could on this device. A key no check observed is not certified by this report.",
        "",
        *evidence_markdown(result.evidence()),
        "",
        *_hardware_section(result),
    ]
    if not result.ok:
        lines += ["## Failures", ""]
        for v in result.failures():
            lines.append(f"- `{v.case}`: " + "; ".join(v.reasons))
        lines.append("")
    if result.expected() or result.unexpected_passes():
        lines += ["## Expected failures (declared with --xfails; they do not fail the run)", ""]
        for v in result.expected():
            lines.append(f"- `{v.case}` (expected: {result.expected_failures[v.case]}): " + "; ".join(v.reasons))
        for v in result.unexpected_passes():
            lines.append(
                f"- `{v.case}` passed although expected to fail ({result.expected_failures[v.case]}): drop the entry"
            )
        lines.append("")
    lines += [
        "## Per family (largest difference over its cases)",
        "",
        "| family | passed | max loss diff | max grad-norm rel diff | max param diff | max checkpoint output diff |",
        "|---|---|---|---|---|---|",
    ]
    for fam, s in families.items():
        lines.append(f"| {fam} | {s['passed']}/{s['cases']} | " + " | ".join(_g(s[k]) for k in _STATS) + " |")
    lines += [
        "",
        "## Cases",
        "",
        "| case | dtype | verdict | max loss diff | max grad-norm rel diff | max param diff | checkpoint output diff | checkpoint state diff | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    dtypes = {c.name: c.dtype for c in result.cases}
    for v in result.verdicts:
        notes = "; ".join(v.reasons).replace("|", "\\|")
        shown = "pass" if v.ok else "expected fail" if v.case in result.expected_failures else "**FAIL**"
        lines.append(
            f"| {v.case} | {dtypes.get(v.case, '')} | {shown} | {_g(v.max_loss_diff)} | "
            f"{_g(v.max_grad_norm_rel_diff)} | {_g(v.max_param_diff)} | {_g(v.max_output_diff)} | "
            f"{_g(v.checkpoint_param_diff)} | {notes} |"
        )
    lines += _communication_table(result)
    methods = sorted({v.checkpoint_method for v in result.verdicts if v.checkpoint_method})
    lines += [
        "",
        "## Tolerances",
        "",
        "A step's loss passes when |sharded - reference| <= loss_atol + loss_rtol * |reference|; gradient norms are "
        "compared relatively, final parameters and buffers absolutely (frozen parameters must be bit-identical), and "
        "the checkpoint round trip must restore the sharded model's state exactly (checkpoint_atol) and give outputs "
        "within output_atol of the reference model's.",
        "",
        "| dtype | " + " | ".join(vars(next(iter(TOLERANCES.values())))) + " |",
        "|---|" + "---|" * len(vars(next(iter(TOLERANCES.values())))),
    ]
    for k, t in TOLERANCES.items():
        lines.append(f"| {k} | " + " | ".join(f"{x:g}" for x in vars(t).values()) + " |")
    if methods:
        lines += ["", "Checkpoint round trip: " + "; ".join(methods) + "."]
    lines += ["", "## Config keys", "", "| key | cases that set it |", "|---|---|"]
    for k in sorted(result.supported_keys):
        names = coverage.get(k, [])
        shown = ", ".join(names[:6]) + (f" (+{len(names) - 6})" if len(names) > 6 else "")
        lines.append(f"| `{k}` | {shown or '**none**'} |")
    if uncovered:
        lines += [
            "",
            f"The backend declares {', '.join(uncovered)} but no case sets them (the suite has no dimension for them).",
        ]
    if plot_files:
        lines += [
            "",
            "## Loss curves",
            "",
            "Top: loss per step, reference (line) and sharded (dots). Bottom: |sharded - reference| per step "
            "(an exact match is drawn at 1e-12) and the tolerance (dashed).",
            "",
        ]
        for p in plot_files:
            lines.append(f"![{p.stem}]({p.relative_to(out).as_posix()})")
    return "\n".join(lines) + "\n"


def _plots(result: "SuiteResult", cases: list[Case], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator, NullLocator
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'shardcore-conformance[plots]')")
        return []
    by_family: dict[str, list[Case]] = {}
    for c in cases:
        by_family.setdefault(c.family, []).append(c)
    verdicts = {v.case: v for v in result.verdicts}
    (out / "plots").mkdir(exist_ok=True)
    files = []
    per_row = 6
    for fam, fcases in by_family.items():
        ncol = min(per_row, len(fcases))
        nblock = math.ceil(len(fcases) / per_row)
        fig, axes = plt.subplots(2 * nblock, ncol, figsize=(2.9 * ncol, 4.4 * nblock), squeeze=False)
        for ax in axes.flat:
            ax.set_visible(False)
        for i, c in enumerate(fcases):
            top, bottom = axes[2 * (i // per_row), i % per_row], axes[2 * (i // per_row) + 1, i % per_row]
            _plot_case(top, bottom, c, result.reference[c.name], result.sharded[c.name], verdicts[c.name])
            for ax in (top, bottom):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            # a log axis's minor ticks cost more to lay out than the rest of the figure, and say nothing here
            bottom.yaxis.set_minor_locator(NullLocator())
        fig.suptitle(f"{result.backend}, world size {result.world_size}: {fam}", fontsize=10)
        # fixed margins in inches, not tight_layout: measuring every tick label made a full report's
        # plots take 48 s of a 75 s FSDP2 suite run
        height = 4.4 * nblock
        fig.subplots_adjust(
            left=0.5 / (2.9 * ncol),
            right=0.97,
            bottom=0.35 / height,
            top=1 - 0.8 / height,
            hspace=0.6,
            wspace=0.45,
        )
        path = out / "plots" / f"loss-{fam}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(path)
    return files


def _plot_case(top, bottom, c: Case, ref: dict[str, Any], got: dict[str, Any], v: Verdict) -> None:
    for ax in (top, bottom):
        ax.set_visible(True)
        ax.tick_params(labelsize=6)
    color = "black" if v.ok else "red"
    top.set_title(f"{c.name}\n{'pass' if v.ok else 'FAIL'}", fontsize=7, color=color)
    rl, gl = ref.get("losses"), got.get("losses")
    if not rl or not gl or len(rl) != len(gl):
        top.text(0.5, 0.5, "no comparable losses", ha="center", va="center", fontsize=7, transform=top.transAxes)
        bottom.set_axis_off()
        return
    steps = list(range(len(rl)))
    top.plot(steps, rl, "-", color="tab:blue", label="reference", lw=1.2)
    top.plot(steps, gl, "o", color="tab:orange", label="sharded", ms=3)
    top.legend(fontsize=6)
    tol = TOLERANCES[c.dtype]
    diff = [max(abs(a - b), 1e-12) for a, b in zip(rl, gl)]
    bottom.semilogy(steps, diff, "o-", color=color, ms=3, lw=1, label="|diff|")
    bottom.semilogy(
        steps, [tol.loss_atol + tol.loss_rtol * abs(a) for a in rl], "--", color="gray", lw=1, label="tolerance"
    )
    bottom.set_xlabel("step", fontsize=6)
    bottom.legend(fontsize=6)
