"""Expected failures: the known gaps a vendor declares, so that the rest of the suite still gates.

A file given to ``--xfails`` has one entry per line, a case-name glob pattern (as ``--cases`` takes)
and, after whitespace, the reason; blank lines and lines starting with ``#`` are ignored::

    # our all-gather has no bf16 kernel yet (VENDOR-123)
    *-bf16          bf16 all-gather not implemented
    clip-llama-inf  inf-norm reduction pending

A case matching an entry that fails is reported as an expected failure and does not fail the run;
one that passes is reported as an unexpected pass (the entry is stale) and does not fail it either.
An entry that matches no case of the run is a warning. The in-tree backends ship no xfails.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Xfail:
    pattern: str
    reason: str
    line: int


def read_xfails(path: str | Path) -> list[Xfail]:
    """The entries of an xfails file; ValueError naming the file and line for a malformed one."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--xfails {str(path)!r}: cannot read it ({e.strerror or e})") from None
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, _, reason = line.partition(" ") if " " in line else line.partition("\t")
        reason = reason.strip()
        if not reason:
            raise ValueError(
                f"--xfails {str(path)!r} line {n}: {line!r} has no reason. Write the case pattern, then after a space "
                "why the case is expected to fail."
            )
        out.append(Xfail(pattern, reason, n))
    return out


def expected(xfails: list[Xfail], case_names: list[str]) -> tuple[dict[str, str], list[Xfail]]:
    """``{case: reason}`` for every case an entry matches (the first matching entry's reason), and
    the entries that match no case."""
    reasons: dict[str, str] = {}
    unmatched = []
    for x in xfails:
        hits = [c for c in case_names if fnmatch.fnmatchcase(c, x.pattern)]
        if not hits:
            unmatched.append(x)
        for c in hits:
            reasons.setdefault(c, x.reason)
    return reasons, unmatched
