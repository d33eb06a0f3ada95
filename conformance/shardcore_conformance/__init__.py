"""shardcore-conformance: prove a sharding backend trains to the same numbers as one device."""
from .cases import Case, fsdp2_matrix, select
from .compare import TOLERANCES, Tolerance, Verdict, compare
from .suite import SuiteResult, run_suite

__all__ = ["Case", "SuiteResult", "TOLERANCES", "Tolerance", "Verdict", "compare", "fsdp2_matrix", "run_suite", "select"]
