"""Reference run, sharded run, comparison, report."""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cases import Case, supported_keys
from .compare import Verdict, compare
from .hardware import DEVICE_ENV, resolve
from .launch import run_cases
from .train import PROGRESS_ENV, REFERENCE_DEVICE_ENV, SCRATCH_ENV

log = logging.getLogger(__name__)


@dataclass
class SuiteResult:
    backend: str
    world_size: int
    verdicts: list[Verdict]
    reference: dict[str, dict[str, Any]]
    sharded: dict[str, dict[str, Any]]
    seconds: float
    cases: list[Case] = field(default_factory=list)
    device_type: str | None = None
    supported_keys: frozenset[str] = frozenset()
    #: case -> why it is expected to fail (``--xfails``)
    expected_failures: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No unexpected failure."""
        return not self.failures()

    def failures(self) -> list[Verdict]:
        """Failed cases that were not expected to fail."""
        return [v for v in self.verdicts if not v.ok and v.case not in self.expected_failures]

    def expected(self) -> list[Verdict]:
        """Failed cases that were expected to fail (they do not fail the run)."""
        return [v for v in self.verdicts if not v.ok and v.case in self.expected_failures]

    def placement(self) -> dict[str, Any]:
        """What the sharded run ran on (the first case that reports it): ``requested`` device type,
        ``devices`` and per rank ``hardware``."""
        for c in self.cases:
            p = self.sharded.get(c.name, {}).get("placement")
            if p and p.get("ranks"):
                return p
        return {}

    def hardware(self) -> list[dict[str, Any]]:
        """Each rank's device as torch reported it: type, index, name, runtime."""
        return [r.get("hardware", {}) for r in self.placement().get("ranks", [])]

    def headline(self, extra: str = "") -> str:
        """``fsdp2 on 2 x <device name>: 74/74 passed``, then ``extra`` (expected failures), then the
        keys whose effect no check observed (``; cpu_offload not observable on cpu``)."""
        from .evidence import headline_suffix

        n = self.placement().get("devices") or self.world_size
        names = sorted({h.get("name", "?") for h in self.hardware()}) or [self.device_type or "?"]
        where = f"{n} x {names[0]}" if len(names) == 1 else f"{n} devices ({', '.join(names)})"
        passed = f"{sum(v.ok for v in self.verdicts)}/{len(self.verdicts)} passed"
        return f"{self.backend} on {where}: {passed}{extra}{headline_suffix(self.evidence(), self.device_type)}"

    def evidence(self) -> dict[str, dict[str, Any]]:
        """Per supported key, the checks that observed its effect or why none could (:mod:`.evidence`)."""
        from .evidence import evidence

        return evidence(self)

    def unexpected_passes(self) -> list[Verdict]:
        """Cases expected to fail that passed: the expectation is stale."""
        return [v for v in self.verdicts if v.ok and v.case in self.expected_failures]


def device_env(device_type: str) -> dict[str, str]:
    """Worker environment for a resolved device type (:func:`.hardware.resolve`): the type every
    case is checked against, ``SHARDCORE_DEVICE`` for the backend under test, and the reference on
    the same accelerator. ``cpu`` also hides GPUs; ``cuda`` makes cuBLAS deterministic; ``xla`` is
    the backend's own (``PJRT_DEVICE``)."""
    from shardcore.devices import DEVICE_ENV as SHARDCORE_DEVICE

    env = {DEVICE_ENV: device_type}
    if device_type == "xla":
        return env
    env[SHARDCORE_DEVICE] = device_type
    if device_type == "cpu":
        return {**env, "CUDA_VISIBLE_DEVICES": ""}
    env[REFERENCE_DEVICE_ENV] = device_type
    if device_type == "cuda":
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return env


def run_suite(
    cases: list[Case],
    backend: str,
    world_size: int,
    case_timeout: float = 300.0,
    env: dict[str, str] | None = None,
    report_dir: str | Path | None = None,
    device_type: str | None = None,
    plots: bool = True,
    expected_failures: dict[str, str] | None = None,
) -> SuiteResult:
    """Run every case on the single-device reference and on ``backend`` with ``world_size`` ranks,
    compare them, and (with ``report_dir``) write report.json, report.md and the loss plots there.
    ``expected_failures`` (case -> reason, see :mod:`.xfails`) are reported apart and do not make
    the result fail. ``device_type``: what the run certifies (None or ``auto``: what torch reports,
    ``xla`` for an XLA backend). Progress (case k of n, elapsed seconds, verdicts) is logged at INFO."""
    t0 = time.time()
    device_type = resolve(device_type, backend)
    n = len(cases)
    reference: dict[str, dict[str, Any]] = {}
    verdicts: dict[str, Verdict] = {}

    def verdict(case: Case, result: dict[str, Any]) -> None:
        if "error" in result:
            log.info("%s %s ERROR: %s", backend, case.name, result["error"].splitlines()[0])
            return
        v = verdicts[case.name] = _compare(case, reference[case.name], result)
        if v.ok:
            log.info(
                "%s %s PASS (max diffs: loss %.2g, param %.2g)", backend, case.name, v.max_loss_diff, v.max_param_diff
            )
        else:
            log.info("%s %s FAIL: %s", backend, case.name, v.reasons[0])

    def reference_done(case: Case, result: dict[str, Any]) -> None:
        if "error" in result:
            log.info("reference %s ERROR: %s", case.name, result["error"].splitlines()[0])

    with tempfile.TemporaryDirectory(prefix="shardcore-conformance-") as scratch:
        progress = Path(scratch) / "progress.jsonl"
        progress.touch()
        run_env = {**device_env(device_type), **(env or {}), SCRATCH_ENV: scratch, PROGRESS_ENV: str(progress)}
        stop = threading.Event()
        follower = threading.Thread(target=_follow, args=(progress, 2 * n, t0, stop), daemon=True)
        follower.start()
        try:
            reference.update(run_cases(cases, None, 1, case_timeout, run_env, reference_done))
            sharded = run_cases(cases, backend, world_size, case_timeout, run_env, verdict)
        finally:
            stop.set()
            follower.join()
    ordered = [verdicts.get(c.name) or _compare(c, reference[c.name], sharded[c.name]) for c in cases]
    result = SuiteResult(
        backend,
        world_size,
        ordered,
        reference,
        sharded,
        time.time() - t0,
        list(cases),
        device_type,
        supported_keys(backend),
        dict(expected_failures or {}),
    )
    if report_dir is not None:
        from .report import write_report

        write_report(result, cases, Path(report_dir), plots=plots)
    return result


def _compare(case: Case, ref: dict[str, Any], got: dict[str, Any]) -> Verdict:
    return compare(case.name, ref, got, case.dtype, config=case.config, grad_accum=case.grad_accum)


def _follow(progress: Path, total: int, t0: float, stop: threading.Event) -> None:
    """Log each case as the workers finish it: ``[k/total elapsed] side case (seconds)``."""
    k, pos = 0, 0
    width = len(str(total))
    while True:
        stopping = stop.wait(0.5)
        with progress.open() as f:
            f.seek(pos)
            chunk = f.read()
        # only whole lines; a line being written is read on the next pass
        complete = chunk[: chunk.rfind("\n") + 1]
        pos += len(complete.encode())
        for line in complete.splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            k += 1
            log.info(
                "[%*d/%d %5.0fs] %s %s trained (%.1fs)",
                width,
                k,
                total,
                time.time() - t0,
                d["side"],
                d["case"],
                d["seconds"],
            )
        if stopping:
            return
