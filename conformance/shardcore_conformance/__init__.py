"""shardcore-conformance: prove a sharding backend trains to the same numbers as one device."""

from .cases import Case, covered_keys, fsdp2_matrix, matrix_for, select
from .compare import TOLERANCES, Tolerance, Verdict, compare
from .report import write_report
from .suite import SuiteResult, run_suite

__all__ = [
    "Case",
    "SuiteResult",
    "TOLERANCES",
    "Tolerance",
    "Verdict",
    "compare",
    "covered_keys",
    "fsdp2_matrix",
    "matrix_for",
    "run_suite",
    "select",
    "write_report",
]
