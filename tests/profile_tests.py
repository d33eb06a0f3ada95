"""Where the suite's time goes: a pytest plugin (``-p profile_tests``, ``make profile-tests``).

Per test it records the wall time, the machine's CPU-seconds (user + system of every process, from
``/proc/stat``: a test's ranks, zygote forks and XLA device threads count wherever they run) and the
processes and threads started (the kernel's fork counter). Summed per file, too. The machine must be otherwise
idle for the CPU column to be the test's alone; on a shared machine it is an upper bound. At the end
it prints the top costs and writes every row to ``$SHARDCORE_PROFILE`` (JSON) when that is set, and
each test's wall seconds into ``$SHARDCORE_COSTS`` (``tests/costs.json``, the order ``scheduling.py``
runs tests in) when that is set. The "tasks" column counts processes and threads started (``clone``
calls): a zygote fork or a fresh interpreter, and XLA's and gloo's threads; "zygotes" counts the
zygotes the test process started (each one interpreter's imports, 5 to 8 CPU-s here).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _machine() -> tuple[float, int]:
    """(CPU-seconds of user + system on every core since boot, processes forked since boot)."""
    cpu, forks = 0.0, 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu "):
                user, nice, system = (int(v) for v in line.split()[1:4])
                cpu = (user + nice + system) / _TICK
            elif line.startswith("processes "):
                forks = int(line.split()[1])
    return cpu, forks


class Profile:
    def __init__(self, top: int):
        self.top = top
        self.rows: list[dict] = []
        self.start = (time.monotonic(), *_machine())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        from shardcore_conformance.zygote import Zygote

        wall, (cpu, forks), zygotes = time.monotonic(), _machine(), Zygote.started
        yield
        cpu1, forks1 = _machine()
        self.rows.append(
            {
                "test": item.nodeid,
                "file": item.nodeid.split("::")[0],
                "wall_s": round(time.monotonic() - wall, 2),
                "cpu_s": round(cpu1 - cpu, 2),
                "tasks": forks1 - forks,
                "zygotes": Zygote.started - zygotes,
            }
        )

    def pytest_terminal_summary(self, terminalreporter):
        wall0, cpu0, forks0 = self.start
        cpu1, forks1 = _machine()
        tr = terminalreporter
        total = {"wall_s": time.monotonic() - wall0, "cpu_s": cpu1 - cpu0, "tasks": forks1 - forks0}
        tr.section("profile: where the time went")
        tr.write_line(
            f"session: {total['wall_s']:.0f} s wall, {total['cpu_s']:.0f} CPU-s "
            f"({100 * total['cpu_s'] / max(total['wall_s'], 1e-9):.0f}% of one core), "
            f"{total['tasks']} tasks started, {sum(r['zygotes'] for r in self.rows)} zygotes"
        )
        files: dict[str, dict] = defaultdict(
            lambda: {"wall_s": 0.0, "cpu_s": 0.0, "tasks": 0, "zygotes": 0, "tests": 0}
        )
        for r in self.rows:
            f = files[r["file"]]
            f["tests"] += 1
            for k in ("wall_s", "cpu_s", "tasks", "zygotes"):
                f[k] += r[k]
        for title, rows, key in (
            (f"top {self.top} tests by CPU-s", self.rows, "test"),
            (f"top {self.top} files by CPU-s", [{"test": k, **v} for k, v in files.items()], "test"),
        ):
            tr.write_line(f"\n{title}:")
            tr.write_line(f"{'CPU-s':>8} {'wall s':>8} {'tasks':>6} {'zygotes':>7}  name")
            for r in sorted(rows, key=lambda r: -r["cpu_s"])[: self.top]:
                tr.write_line(f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f} {r['tasks']:6d} {r['zygotes']:7d}  {r[key]}")
        path = os.environ.get("SHARDCORE_PROFILE")
        if path:
            with open(path, "w") as f:
                json.dump({"session": total, "tests": self.rows, "files": files}, f, indent=1)
            tr.write_line(f"\nevery row: {path}")
        costs = os.environ.get("SHARDCORE_COSTS")
        if costs:
            got = json.loads(open(costs).read()) if os.path.isfile(costs) else {}
            got.update({r["test"]: round(r["wall_s"], 1) for r in self.rows})
            with open(costs, "w") as f:
                json.dump(dict(sorted(got.items())), f, indent=0)
                f.write("\n")
            tr.write_line(f"test costs for scheduling.py: {costs}")


def pytest_configure(config):
    config.pluginmanager.register(Profile(int(os.environ.get("SHARDCORE_PROFILE_TOP", "25"))), "shardcore-profile")
