"""The one harness for tests that launch real processes: ranks under torchrun, XLA device processes,
the CLIs. Every launch runs a worker program that is a real file (``tests/workers/``), in a clean
environment (no launcher variables leaking from the test process), in its own process group, and
with a deadline: past it the whole group is killed (torchrun's ranks and xmp.spawn's device process
included) and the test fails, so a hang can never block CI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardcore_conformance.launch import free_port, torchrun_env

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
WORKERS = TESTS / "workers"
BIN = Path(sys.executable).parent

#: what a launcher or an XLA runtime reads; a test process may have them from its own launcher
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PJRT_DEVICE",
    "CPU_NUM_DEVICES",
)


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without launcher variables; plain PyTorch (Transformers
    imports torch_xla whenever it is installed unless ``USE_TORCH_XLA=0``); one OpenMP thread per
    process (several ranks share 2 cores); ``tests/`` importable (workers share ``harness`` and
    ``backends_for_tests``)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    path = [str(TESTS), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(USE_TORCH_XLA="0", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    env.update(extra)
    return env


def xla_env(devices: int, **extra: str) -> dict[str, str]:
    """A clean environment for torch_xla on ``devices`` CPU PJRT devices."""
    env = clean_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), **extra)
    if "USE_TORCH_XLA" not in extra:
        env.pop("USE_TORCH_XLA")
    if "OMP_NUM_THREADS" not in extra and "OMP_NUM_THREADS" not in os.environ:
        env.pop("OMP_NUM_THREADS")  # XLA sizes its own thread pools (the CPU recipe); eager ops keep torch's default
    return env


def worker(name: str) -> Path:
    """A worker program: ``tests/workers/<name>.py``."""
    path = WORKERS / f"{name}.py"
    assert path.is_file(), path
    return path


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path = ROOT, merge: bool = False
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end in its own process group; ``merge`` sends stderr into stdout. Past
    ``timeout`` seconds the group is killed and the test fails (a hang)."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        env=clean_env() if env is None else env,
        cwd=cwd,
        text=True,
        errors="replace",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish within {timeout:g}s:\n{tail(out, err)}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def python(script: Path | str, *args: str, **kw) -> subprocess.CompletedProcess:
    """``python script args``: an XLA program (xmp.spawn starts its own device process), a reference run."""
    return run([sys.executable, script, *args], **kw)


def torchrun(nproc: int, script: Path | str, *args: str, **kw) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc script args``."""
    return run([BIN / "torchrun", "--standalone", "--nproc_per_node", str(nproc), script, *args], **kw)


def start_ranks(
    nproc: int, script: Path | str, *args: str, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """``nproc`` ranks of ``script`` started by hand with the torchrun environment (for tests that
    signal one rank); the caller must kill what is left (:func:`kill_group`)."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        rank_env = {**(clean_env() if env is None else env), **torchrun_env(rank, nproc, port)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=rank_env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
    return procs


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; none found elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group and every process below it: torchrun starts each rank in a
    session of its own, which the group kill alone leaves running (sleeping in a test hook, then
    writing into a finished test's directory)."""
    below = _descendants(proc.pid)
    for pid in below:
        try:
            os.kill(pid, signal.SIGSTOP)  # no rank may start another process while we kill
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def tail(out: str | None, err: str | None = None, n: int = 3000) -> str:
    """The ends of a process's output, for assertion messages."""
    return (out or "")[-n:] + ("\n--- stderr ---\n" + err[-n:] if err else "")


#: what the tests add to XLA_FLAGS (conftest.py says why)
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def xla_flags(flags: str) -> str:
    """``flags`` with the tests' XLA flags added where it does not set them itself."""
    have = flags.split()
    extra = [f for f in TEST_XLA_FLAGS if not any(h.split("=")[0] == f.split("=")[0] for h in have)]
    return " ".join([*have, *extra])


#: another CPU's numerics on this one: XLA:CPU's code generation, torch's own CPU kernels, oneDNN and
#: MKL all capped to SSE4.2 (below AVX2, which every x86-64 CPU of the last decade has). A verdict of
#: the suite must not change with it (tests/test_numerics.py; README "Numerics").
CAPPED_ISA = {
    "XLA_FLAGS": xla_flags("--xla_cpu_max_isa=SSE4_2"),
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
}
