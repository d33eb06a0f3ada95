"""The one harness for tests that launch real processes: ranks under torchrun, XLA device processes,
the CLIs. Every launch runs a worker program that is a real file (``tests/workers/``), in a clean
environment (no launcher variables leaking from the test process), in its own process group, and
with a deadline: past it the whole group is killed (torchrun's ranks and xmp.spawn's device process
included) and the test fails, so a hang can never block CI.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardcore_conformance import zygote
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
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path = ROOT,
    merge: bool = False,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end in its own process group; ``merge`` sends stderr into stdout. Past
    ``timeout`` seconds the group is killed and the test fails (a hang). A Python program or one of
    shardcore's CLIs is a fork of a zygote that imported torch, Transformers and shardcore (and
    torch_xla where ``env`` asks for XLA) in the same environment (:func:`forked`); ``fresh`` starts
    a new interpreter instead, for a test of what one imports."""
    env = clean_env() if env is None else env
    argv = None if fresh else forked(cmd, env)
    if argv is not None:
        proc, out, err = _start_forked(argv, env, cwd, merge)
    else:
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            env=env,
            cwd=cwd,
            text=True,
            errors="replace",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE,
            start_new_session=True,
        )
        out, err = proc.stdout, proc.stderr
    try:
        stdout, stderr = _communicate(proc, out, err, timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = _communicate(proc, out, err, 60)
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish within {timeout:g}s:\n{tail(stdout, stderr)}")
    return subprocess.CompletedProcess([str(c) for c in cmd], proc.wait(), stdout, stderr)


#: this environment's console scripts that the harness runs as a zygote's forks (each is a Python file)
CONSOLE_SCRIPTS = ("shardcore", "shardcore-conformance")


def forked(cmd: list, env: dict[str, str]) -> list[str] | None:
    """The argv a zygote's fork runs for ``cmd``, or None where ``cmd`` starts fresh:
    ``python script.py ...`` and shardcore's CLIs fork, since importing torch and Transformers (and
    torch_xla) is most of a short program's time (5 to 8 s of CPU here), and a CLI's CPU workers are
    forks of the same zygote (:func:`shardcore_conformance.zygote.parent`). ``torchrun`` and
    ``accelerate launch`` start fresh: their launch is what those tests are about."""
    if len(cmd) >= 2 and str(cmd[0]) == sys.executable and str(cmd[1]).endswith(".py") and Path(cmd[1]).is_file():
        return [str(c) for c in cmd[1:]]
    if cmd and Path(cmd[0]).parent == BIN and Path(cmd[0]).name in CONSOLE_SCRIPTS:
        return [str(c) for c in cmd]
    return None


def _start_forked(argv, env, cwd, merge):
    out_r, out_w = os.pipe()
    err_r, err_w = (None, None) if merge else os.pipe()
    try:
        proc = zygote.shared().get(env).start(argv, env=env, cwd=cwd, stdout=out_w, stderr=out_w if merge else err_w)
    finally:
        os.close(out_w)
        if err_w is not None:
            os.close(err_w)
    reader = functools.partial(open, mode="r", errors="replace")
    return proc, reader(out_r), (reader(err_r) if err_r is not None else None)


def _communicate(proc, out, err, timeout: float) -> tuple[str, str | None]:
    """Read ``out`` and ``err`` to their ends and wait for ``proc``, within ``timeout`` seconds
    (``subprocess.TimeoutExpired`` past it; the reading goes on, and a second call collects it)."""
    if not hasattr(proc, "_harness_readers"):
        got: dict[str, str] = {}

        def read(name, stream):
            got[name] = stream.read()
            stream.close()

        threads = [
            threading.Thread(target=read, args=(n, s), daemon=True) for n, s in (("out", out), ("err", err)) if s
        ]
        for t in threads:
            t.start()
        proc._harness_readers = (threads, got)
    threads, got = proc._harness_readers
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait(max(0.0, deadline - time.monotonic()) + 5)
    return got.get("out", ""), got.get("err")


def python(script: Path | str, *args: str, **kw) -> subprocess.CompletedProcess:
    """``python script args``: an XLA program (xmp.spawn starts its own device process), a reference run."""
    return run([sys.executable, script, *args], **kw)


def torchrun(nproc: int, script: Path | str, *args: str, **kw) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc script args``."""
    return run([BIN / "torchrun", "--standalone", "--nproc_per_node", str(nproc), script, *args], **kw)


def ranks(nproc: int, script: Path | str, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    """``nproc`` ranks of ``python script args`` with torchrun's variables, as forks of a zygote
    that imported torch, Transformers and shardcore (``torchrun`` and its ranks would import them
    ``nproc + 1`` times, 5 s of CPU each here), for tests of what the ranks do rather than of the
    launcher. As torchrun: stdout and stderr of every rank in one stream, the others killed once one
    fails, and a non-zero exit status if any failed. Past ``timeout`` the test fails."""
    env = clean_env() if env is None else env
    port = free_port()
    out_r, out_w = os.pipe()
    procs = []
    try:
        for rank in range(nproc):
            rank_env = {**env, **torchrun_env(rank, nproc, port)}
            z = zygote.shared().get(rank_env)
            procs.append(z.start([script, *args], env=rank_env, cwd=ROOT, stdout=out_w, stderr=out_w))
    finally:
        os.close(out_w)
    stream = open(out_r, errors="replace")
    got: dict[str, str] = {}
    reader = threading.Thread(target=lambda: got.update(out=stream.read()), daemon=True)
    reader.start()
    status = zygote.join_group(procs, timeout)
    for p in procs:
        if p.poll() is None:
            kill_group(p)
    reader.join(60)
    if status is None:
        pytest.fail(f"{script} on {nproc} ranks did not finish within {timeout:g}s:\n{tail(got.get('out'))}")
    cmd = [sys.executable, str(script), *map(str, args)]
    return subprocess.CompletedProcess(cmd, status[1], got.get("out", ""), None)


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
    # the process itself too: a zygote's fork is returned before it calls setsid(), and until then
    # no group has its pid (a busy machine once left one asleep past the 30 s below)
    proc.kill()
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


#: the line a process prints as native code kills it: glibc's heap checks, C++'s terminate, Python's
#: faulthandler. It names the cause, and the other ranks' tracebacks push it out of a tail.
_CRASH = re.compile(
    r"^(free\(\)|malloc\(\)|realloc\(\)|double free|corrupted |munmap_chunk|terminate called|Fatal Python error)"
)


def tail(out: str | None, err: str | None = None, n: int = 3000) -> str:
    """The ends of a process's output, for assertion messages, after any native crash lines in it."""
    crashes = [ln for ln in f"{out or ''}\n{err or ''}".splitlines() if _CRASH.match(ln.lstrip())]
    head = "crashed in native code:\n" + "\n".join(crashes[:10]) + "\n--- tail ---\n" if crashes else ""
    return head + (out or "")[-n:] + ("\n--- stderr ---\n" + err[-n:] if err else "")


#: what the tests add to XLA_FLAGS (conftest.py says why)
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def xla_flags(flags: str) -> str:
    """``flags`` with the tests' XLA flags added where it does not set them itself."""
    have = flags.split()
    extra = [f for f in TEST_XLA_FLAGS if not any(h.split("=")[0] == f.split("=")[0] for h in have)]
    return " ".join([*have, *extra])


#: another CPU's numerics on this one: XLA:CPU's code generation, torch's own CPU kernels, oneDNN and
#: MKL all capped to SSE4.2 (below AVX2, which every x86-64 CPU of the last decade has). A verdict of
#: the suite must not change with it (tests/test_numerics.py; docs/numerics.md).
CAPPED_ISA = {
    "XLA_FLAGS": xla_flags("--xla_cpu_max_isa=SSE4_2"),
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
}

#: the AVX2-only CPU (AMD EPYC before Zen 4, Intel client chips) on an AVX-512 one; where the machine
#: itself is AVX2-only this is its native setting
AVX2_ISA = {
    "XLA_FLAGS": xla_flags("--xla_cpu_max_isa=AVX2"),
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
