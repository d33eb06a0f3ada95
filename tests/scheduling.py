"""The order tests run in, and which must share a process, for ``pytest -n 2 --dist loadgroup``.

* Tests that use one module- or session-scoped fixture form one ``xdist_group``, so one worker sets it
  up once (the FSDP2 matrix, a resume chain), as a serial run would.
* Work units run longest first, by ``tests/costs.json`` (each test's wall seconds, written by ``make
  profile-tests``): two workers then finish close together instead of one waiting on the matrix at
  the end. A test missing from the file counts as free; a stale file only unbalances, never breaks.

The serial run takes the same order, so a failure under xdist reproduces without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("costs.json")


def shared_fixture(item: pytest.Item) -> str | None:
    """The first (by name) fixture wider than a function that ``item`` uses, as ``file::name``."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in sorted(info.name2fixturedefs):
        defs = info.name2fixturedefs[name]
        if defs and defs[-1].scope in ("module", "package", "session") and not name.startswith("_"):
            if name in ("tmp_path_factory", "testrun_uid", "worker_id", "pytestconfig"):
                continue
            return f"{defs[-1].baseid or item.nodeid.split('::')[0]}::{name}"
    return None


def _join_group(item: pytest.Item, group: str) -> None:
    """What xdist's worker does for an ``xdist_group`` mark under ``--dist loadgroup``: the group
    as a suffix of the node id, which its scheduler reads. xdist 3.8 sets ``item._nodeid``, which
    pytest 9 no longer reads (its node ids are ``NodeId`` objects), so every test would be a unit of
    its own and a module fixture would be set up on both workers."""
    from _pytest.nodeid import NodeId

    if not item.nodeid.endswith("@" + group):
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    costs = json.loads(COSTS.read_text()) if COSTS.is_file() else {}
    loadgroup = getattr(config.option, "loadgroup", False)  # set in xdist's workers only
    units: dict[str, list[pytest.Item]] = {}
    cost = {item: costs.get(item.nodeid, 0.0) for item in items}  # before a group suffix
    for item in items:
        group = shared_fixture(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        units.setdefault(group or item.nodeid, []).append(item)
        if group is not None and loadgroup:
            _join_group(item, group)
    # sorted() is stable: equal costs keep the collection's order, and a group keeps its tests' order
    ordered = sorted(units.values(), key=lambda unit: -sum(cost[i] for i in unit))
    items[:] = [item for unit in ordered for item in unit]
