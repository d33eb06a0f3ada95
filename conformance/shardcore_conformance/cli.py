"""``shardcore-conformance``: run the conformance suite against a backend, write the report.

    shardcore-conformance --backend fsdp2 --world-size 2 --report conformance-report
    shardcore-conformance --backend my_pkg:MyBackend --list
    shardcore-conformance --backend fsdp2 --world-size 8 --device-type cuda --cases 'llama-*' --dtype bf16 --report out

It starts the ranks itself (one process per rank, or the backend's own launcher), runs every case
on a single-device reference and sharded, compares them and exits 0 only when every case passes or
is an expected failure (``--xfails``): 1 on a mismatch or a failed case, 2 on a usage error
(unknown backend, no matching case, a malformed xfails file, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardcore-conformance",
        description="Prove that a shardcore backend trains to the same numbers as a single device.",
        epilog="Exit status: 0 every case passed, 1 a mismatch or a failed case, 2 a usage error.",
    )
    p.add_argument(
        "--backend",
        default="fsdp2",
        help="registered backend name (entry point in group shardcore.backends) or module:Class (default: fsdp2)",
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks/devices of the sharded run (default: 2)")
    p.add_argument(
        "--device-type",
        default="auto",
        metavar="auto|cpu|ACCELERATOR|xla",
        help="what the run certifies. auto (default): the accelerator torch reports (torch.accelerator), "
        "the CPU where there is none, xla for the XLA backend; cpu: the CPU (gloo) even where an "
        "accelerator is present; an accelerator type (cuda, xpu, hpu, mps, a PrivateUse1 name): one device "
        "per rank, its distributed backend, the reference on that device too; xla: the backend's XLA "
        "devices. Every case fails that ran elsewhere.",
    )
    p.add_argument(
        "--cases",
        default=None,
        metavar="PATTERN",
        help="comma-separated glob patterns of case names (see --list), e.g. 'llama-*,frozen-*'",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="fp32: only full-precision cases; bf16: every case in bf16 through the backend's "
        "mixed-precision key. Default: fp32 matrix plus the bf16 cases of each low-precision key.",
    )
    p.add_argument(
        "--xfails",
        default=None,
        metavar="FILE",
        help="known gaps: one 'CASE-PATTERN REASON' per line; those cases failing does not fail the run "
        "(reported apart), entries matching no case are warned about",
    )
    p.add_argument(
        "--report",
        default="conformance-report",
        metavar="DIR",
        help="directory for report.json, report.md and plots/ (default: conformance-report)",
    )
    p.add_argument(
        "--case-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a case (start-up included) that runs longer is killed and fails (default: 300)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--list", action="store_true", help="list the cases this backend gets, then exit")
    p.add_argument("--json", action="store_true", help="with --list: one JSON object per case")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case progress on stderr")
    return p


def _device_problem(device_type: str, world_size: int) -> str | None:
    """Why this machine cannot run ``world_size`` ranks on ``device_type`` (None: it can)."""
    if device_type in ("cpu", "xla"):
        return None
    import torch

    try:
        torch.device(device_type)
    except RuntimeError:
        return f"--device-type {device_type!r} is no torch device type; use auto, cpu, xla or an accelerator type (cuda, xpu, ...)"
    from shardcore.devices import accelerator

    have = accelerator()
    if have != device_type:
        return f"--device-type {device_type}, but torch reports " + (
            f"the accelerator {have!r}" if have else "no accelerator (torch.accelerator.is_available() is False)"
        )
    count = torch.accelerator.device_count()
    if count < world_size:
        return f"--device-type {device_type} --world-size {world_size}, but torch sees only {count} {device_type} device(s)"
    return None


def _error(msg: str) -> int:
    print(f"shardcore-conformance: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.device_type not in ("xla", "auto"):
        # Transformers would start an XLA runtime in this process and in every worker otherwise
        os.environ.setdefault("USE_TORCH_XLA", "0")
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    if not args.quiet:
        logging.getLogger("shardcore_conformance").setLevel(logging.INFO)

    import shardcore

    from .cases import matrix_for, select
    from .suite import run_suite

    if args.world_size < 1:
        return _error(f"--world-size must be >= 1, got {args.world_size}")
    try:
        backend = shardcore.get_backend(args.backend)
    except shardcore.ShardcoreError as e:
        return _error(str(e))
    try:
        cases = select(matrix_for(backend, args.world_size, args.dtype), args.cases)
    except ValueError as e:
        return _error(str(e))
    if not cases:
        return _error(f"no case matches --cases {args.cases!r}; --list shows the cases of backend {args.backend!r}")
    expected_failures: dict[str, str] = {}
    if args.xfails is not None:
        from .xfails import expected, read_xfails

        try:
            expected_failures, unmatched = expected(read_xfails(args.xfails), [c.name for c in cases])
        except ValueError as e:
            return _error(str(e))
        for x in unmatched:
            print(
                f"shardcore-conformance: warning: --xfails {args.xfails} line {x.line}: {x.pattern!r} matches no case "
                "of this run",
                file=sys.stderr,
            )
    if args.list:
        for c in cases:
            if args.json:
                print(json.dumps(c.to_dict()))
            else:
                print(f"{c.name:<40} {c.dtype:<5} {c.family:<18} {json.dumps(c.config, sort_keys=True)}")
        print(
            f"{len(cases)} cases for backend {args.backend!r} (supported keys: "
            f"{', '.join(sorted(backend.supported_keys)) or 'none'})",
            file=sys.stderr,
        )
        return EXIT_OK
    ok, reason = backend.is_available()
    if not ok:
        return _error(
            f"backend {args.backend!r} is not available here: {reason}. Install it with: {backend.install_hint}"
        )
    from .hardware import resolve

    device_type = resolve(args.device_type, args.backend)
    problem = _device_problem(device_type, args.world_size)
    if problem:
        return _error(problem)

    t0 = time.time()
    print(
        f"shardcore-conformance: backend {args.backend!r} on {device_type}, world size {args.world_size}, {len(cases)} cases "
        f"(each once on one device and once sharded), case timeout {args.case_timeout:g}s",
        file=sys.stderr,
    )
    result = run_suite(
        cases,
        args.backend,
        args.world_size,
        case_timeout=args.case_timeout,
        report_dir=args.report,
        device_type=device_type,
        plots=not args.no_plots,
        expected_failures=expected_failures,
    )
    for v in result.failures():
        print(f"FAIL {v.case}: {'; '.join(v.reasons)}")
    for v in result.expected():
        print(f"XFAIL {v.case} (expected: {expected_failures[v.case]}): {'; '.join(v.reasons)}")
    for v in result.unexpected_passes():
        print(f"XPASS {v.case}: passed although --xfails expects it to fail ({expected_failures[v.case]})")
    xf = f", {len(result.expected())} expected failures" if result.expected() else ""
    print(
        f"{'PASS' if result.ok else 'FAIL'}: {result.headline(xf)} in {time.time() - t0:.0f}s; "
        f"report: {os.path.join(args.report, 'report.md')}"
    )
    return EXIT_OK if result.ok else EXIT_MISMATCH


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
