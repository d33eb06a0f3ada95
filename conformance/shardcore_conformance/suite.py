"""Reference run, sharded run, comparison, report."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cases import Case
from .compare import TOLERANCES, Verdict, compare
from .launch import run_cases

log = logging.getLogger(__name__)


@dataclass
class SuiteResult:
    backend: str
    world_size: int
    verdicts: list[Verdict]
    reference: dict[str, dict[str, Any]]
    sharded: dict[str, dict[str, Any]]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.ok]


def run_suite(
    cases: list[Case],
    backend: str,
    world_size: int,
    case_timeout: float = 300.0,
    env: dict[str, str] | None = None,
    report_dir: str | Path | None = None,
) -> SuiteResult:
    """Run every case on the single-device reference and on ``backend`` with ``world_size`` ranks."""
    t0 = time.time()
    n = len(cases)
    counter = {"done": 0}

    def progress(case: Case, result: dict[str, Any]) -> None:
        counter["done"] += 1
        status = "error" if "error" in result else "done"
        log.info("[%d/%d] %s %s (%.0fs elapsed)", counter["done"], 2 * n, case.name, status, time.time() - t0)

    reference = run_cases(cases, None, 1, case_timeout, env, progress)
    sharded = run_cases(cases, backend, world_size, case_timeout, env, progress)
    verdicts = [compare(c.name, reference[c.name], sharded[c.name], c.dtype) for c in cases]
    result = SuiteResult(backend, world_size, verdicts, reference, sharded, time.time() - t0)
    if report_dir is not None:
        write_report(result, cases, Path(report_dir))
    return result


def write_report(result: SuiteResult, cases: list[Case], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    by_name = {c.name: c for c in cases}
    rows = []
    for v in result.verdicts:
        ref, got = result.reference[v.case], result.sharded[v.case]
        rows.append(
            {
                **v.to_dict(),
                "config": by_name[v.case].config,
                "model": by_name[v.case].model,
                "dtype": by_name[v.case].dtype,
                "reference_losses": ref.get("losses"),
                "sharded_losses": got.get("losses"),
                "reference_grad_norms": ref.get("grad_norms"),
                "sharded_grad_norms": got.get("grad_norms"),
            }
        )
    doc = {
        "backend": result.backend,
        "world_size": result.world_size,
        "ok": result.ok,
        "seconds": round(result.seconds, 1),
        "tolerances": {k: vars(t) for k, t in TOLERANCES.items()},
        "cases": rows,
    }
    (out / "report.json").write_text(json.dumps(doc, indent=2, default=float))
    lines = [
        f"# shardcore conformance: backend `{result.backend}`, world size {result.world_size}",
        "",
        f"{'PASS' if result.ok else 'FAIL'}: {sum(v.ok for v in result.verdicts)}/{len(result.verdicts)} cases "
        f"in {result.seconds:.0f}s",
        "",
        "| case | verdict | max loss diff | max grad-norm rel diff | max param diff | notes |",
        "|---|---|---|---|---|---|",
    ]
    for v in result.verdicts:
        lines.append(
            f"| {v.case} | {'pass' if v.ok else 'FAIL'} | {v.max_loss_diff:.3g} | {v.max_grad_norm_rel_diff:.3g} | "
            f"{v.max_param_diff:.3g} | {'; '.join(v.reasons)} |"
        )
    lines += ["", "Tolerances:", ""]
    for k, t in TOLERANCES.items():
        lines.append(f"- {k}: {vars(t)}")
    (out / "report.md").write_text("\n".join(lines) + "\n")
