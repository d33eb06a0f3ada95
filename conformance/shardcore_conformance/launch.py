"""Run cases in real worker processes, with a deadline per case.

One process group serves many cases (start-up dominates on small CPUs). Each rank reports which
case it is in; if a case fails or overruns its deadline, the whole group is killed, that case is
recorded as an error, and the remaining cases run in a fresh group. Nothing can block forever.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from shardcore.capabilities import DeviceLaunch, LaunchSpec

from .cases import Case

log = logging.getLogger(__name__)


def launch_spec(backend: str | None, case: Case, world_size: int) -> LaunchSpec:
    if backend is None:
        return LaunchSpec(1)
    import shardcore

    b = shardcore.get_backend(backend)
    if not isinstance(b, DeviceLaunch):
        return LaunchSpec(world_size)
    return b.launch_spec(shardcore.parse_config(case.config), world_size)


#: what every CPU worker imports before its first case (about 5 s of CPU on a small machine). A fork
#: server imports it once per launching process, and each worker is a fork of it; over a test session
#: that starts some 40 groups of workers, that is minutes.
_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "shardcore",
    "shardcore_conformance.train",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "shardcore_conformance._freeze_imports",  # last: freezes what the others created
]
#: variables a worker may set that no preloaded module reads at import (the rest are read at import,
#: e.g. Transformers' USE_TORCH_XLA, or by a kernel library on first use, e.g. ATEN_CPU_CAPABILITY,
#: and must be seen by a fresh interpreter)
_FORK_SAFE_ENV = frozenset({"SHARDCORE_CONFORMANCE_SCRATCH", "SHARDCORE_CONFORMANCE_PROGRESS", "CUDA_VISIBLE_DEVICES"})
_server_env: dict[str, str] | None = None


def worker_start_method(backend: str | None, per_device: bool, env: dict[str, str]) -> str:
    """How a group of workers starts.

    * ``forkserver``: workers that run on the CPU with what the fork server imported;
    * ``zygote``: XLA workers on CPU PJRT devices, forks of a zygote (:mod:`.zygote`) that imported
      torch_xla in the group's environment (torch_xla and Transformers choose their modes at import,
      so the fork server, which imported Transformers without XLA, cannot serve them);
    * ``spawn`` (a fresh interpreter): other XLA devices, a machine with CUDA (forking around a CUDA
      context is unsafe), and a launch whose environment changes a variable an import may read
      from the fork server's (:func:`cpu_fork_method`).

    A runner that is itself a zygote's fork (the CLI under the test suite) starts CPU workers of the
    zygote's environment as the zygote's forks too, where that zygote imported Transformers in
    plain-PyTorch mode as the fork server does: no fork server to import everything again."""
    if torch.cuda.is_available():
        return "spawn"
    if backend is not None and "xla" in backend:
        return "zygote" if env.get("PJRT_DEVICE") == "CPU" else "spawn"
    if per_device:
        return "spawn"
    from .zygote import import_env, parent

    worker_env = _worker_env(env)
    if parent() is not None and not worker_env.get("PJRT_DEVICE") and import_env(worker_env) in parent().serves:
        return "zygote"
    return cpu_fork_method(env)


def cpu_fork_method(env: dict[str, str]) -> str:
    """``forkserver`` for CPU processes that run in this process's environment with ``env`` on top,
    from a fork server that imported :data:`_PRELOAD` once (started on first use); ``spawn`` where
    ``env`` changes a variable an import may read (:func:`.zygote.import_env`; not ``_FORK_SAFE_ENV``)
    from the server's. The child must apply ``env`` itself: a fork server's children inherit the
    server's environment, not the caller's. shardcore's ``SHARDCORE_*`` variables, the device the
    suite certifies among them, are read when a run starts: the reference of an XLA run forks too."""
    global _server_env
    import multiprocessing.forkserver as forkserver

    from .zygote import import_env

    # the server inherits this environment, plus Transformers in plain-PyTorch mode (_worker); decided
    # before it starts, so that a launch that must spawn does not start a server for nothing
    server_env = _server_env if _server_env is not None else {**os.environ, "USE_TORCH_XLA": "0"}
    changed = {k for k, v in import_env(env).items() if k not in _FORK_SAFE_ENV and server_env.get(k) != v}
    if changed:
        return "spawn"
    if _server_env is None:
        saved = os.environ.get("USE_TORCH_XLA")
        os.environ["USE_TORCH_XLA"] = "0"
        try:
            mp.set_forkserver_preload(_PRELOAD)
            forkserver.ensure_running()
            _server_env = server_env
        finally:
            if saved is None:
                del os.environ["USE_TORCH_XLA"]
            else:
                os.environ["USE_TORCH_XLA"] = saved
    return "forkserver"


def _worker_env(env: dict[str, str]) -> dict[str, str]:
    """What a zygote for the workers must serve: this process's environment with ``env`` on top, but
    for the variables no import reads, which ``_worker`` sets itself."""
    return {**os.environ, **{k: v for k, v in env.items() if k not in _FORK_SAFE_ENV}}


def _start_forked(nprocs: int, args: tuple, env: dict[str, str], scratch: Path) -> "_ForkedWorkers":
    """``nprocs`` workers as forks of the zygote for this process's environment with ``env`` on top,
    and with this process's ``sys.path`` (a backend named by ``module:Class`` is found as with spawn)."""
    from .zygote import shared

    worker_env = _worker_env(env)
    spec = scratch / "worker-args.json"
    spec.write_text(json.dumps(list(args)))
    program = Path(__file__).with_name("_zygote_worker.py")
    zygote = shared().get(worker_env)
    procs = [
        zygote.start([program, str(rank), spec], env=worker_env, cwd=os.getcwd(), stdout=1, stderr=2, path=sys.path)
        for rank in range(nprocs)
    ]
    return _ForkedWorkers(procs)


class _ForkedWorkers:
    """What ``_wait`` and ``_kill`` use of torch's ``ProcessContext``, for a zygote's forks."""

    def __init__(self, procs):
        self.processes = [_Forked(p) for p in procs]

    def join(self, timeout: float | None = None) -> bool:
        from .zygote import join_group

        status = join_group([p.proc for p in self.processes], timeout or 0)
        if status is None:
            return False
        i, code = status
        if code:
            raise ProcessExitedException(
                f"process {i} terminated with exit code {code}", i, self.processes[i].pid, code
            )
        return True


class _Forked:
    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        """As ``multiprocessing.Process.exitcode``: negative for a signal's number."""
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of ``world_size`` on one machine, for processes
    this package (and the benchmarks) start themselves."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    nprocs: int,
    per_device: bool,
    world_size: int,
    port: int,
    cases: list[dict],
    backend: str | None,
    out_dir: str,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    if backend is None or "xla" not in backend:
        # Transformers imports torch_xla whenever it is installed unless told not to (its own advice
        # for plain-PyTorch jobs); an XLA runtime in an FSDP2 or reference process is dead weight.
        os.environ.setdefault("USE_TORCH_XLA", "0")
    if nprocs > 1:
        os.environ.update(torchrun_env(rank, world_size, port))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if per_device:
        import shardcore

        from .models import initial_states

        run_on_devices = shardcore.get_backend(backend).run_on_devices
        # built here, before any device thread exists: seeding inside device threads races (models.py)
        initial = initial_states({(c["model"], c["seed"] + k) for c in cases for k in (0, 1)})
        # a partial of a module-level function pickles, for launchers that start processes per device
        run_on_devices(
            functools.partial(_run_cases_here, cases=cases, backend=backend, out=Path(out_dir), initial=initial)
        )
    else:
        _run_cases_here(rank, cases, backend, Path(out_dir))


def _run_cases_here(rank: int, cases: list[dict], backend: str | None, out: Path, initial: dict | None = None) -> None:
    from .models import preload
    from .train import run_case

    if initial:
        preload(initial)

    for d in cases:
        case = Case.from_dict(d)
        (out / f"progress.{rank}").write_text(json.dumps({"case": case.name, "t": time.time()}))
        try:
            result = run_case(case, backend, rank)
        except BaseException:
            (out / f"{case.name}.error.{rank}").write_text(traceback.format_exc())
            raise
        if rank == 0:
            tmp = out / f".{case.name}.pt.tmp"
            torch.save(result, tmp)
            os.replace(tmp, out / f"{case.name}.pt")
    (out / f"progress.{rank}").write_text(json.dumps({"case": None, "t": time.time()}))


def run_cases(
    cases: list[Case],
    backend: str | None,
    world_size: int,
    case_timeout: float = 300.0,
    env: dict[str, str] | None = None,
    on_case_done: Callable[[Case, dict[str, Any]], None] | None = None,
    start_method: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Run ``cases`` on ``world_size`` ranks (``backend`` None: the single-device reference, one
    process). Returns name -> result dict, or name -> {"error": text} for a case that failed.
    ``start_method`` overrides :func:`worker_start_method`'s choice (``spawn``: fresh interpreters)."""
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        spec = launch_spec(backend, c, world_size)
        groups.setdefault((spec.group, spec.processes, spec.per_device, tuple(sorted(spec.env.items()))), []).append(c)
    results: dict[str, dict[str, Any]] = {}
    for (_, nprocs, per_device, spec_env), group in groups.items():
        results.update(
            _run_group(
                group,
                backend,
                world_size,
                nprocs,
                per_device,
                {**dict(spec_env), **(env or {})},
                case_timeout,
                on_case_done,
                start_method,
            )
        )
    return results


def _run_group(
    cases, backend, world_size, nprocs, per_device, env, case_timeout, on_case_done, start
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    pending = list(cases)
    with tempfile.TemporaryDirectory(prefix="shardcore-conf-") as tmp:
        while pending:
            out = Path(tempfile.mkdtemp(dir=tmp))
            start_method = start or worker_start_method(backend, per_device, env)
            args = (nprocs, per_device, world_size, free_port(), [c.to_dict() for c in pending], backend, str(out), env)
            if start_method == "zygote":
                ctx = _start_forked(nprocs, args, env, out)
            else:
                ctx = mp.start_processes(_worker, args=args, nprocs=nprocs, join=False, start_method=start_method)
            failure = _wait(ctx, out, nprocs, case_timeout, pending)
            done = [c for c in pending if (out / f"{c.name}.pt").exists()]
            for c in done:
                results[c.name] = torch.load(out / f"{c.name}.pt", weights_only=True)
                if on_case_done:
                    on_case_done(c, results[c.name])
            remaining = [c for c in pending if c.name not in results]
            if failure is None:
                if remaining:  # pragma: no cover - workers exit only after the last case
                    raise RuntimeError(f"workers exited without results for {[c.name for c in remaining]}")
                break
            bad_name, message = failure
            bad = next((c for c in remaining if c.name == bad_name), remaining[0] if remaining else None)
            if bad is None:
                break
            results[bad.name] = {"error": message}
            if on_case_done:
                on_case_done(bad, results[bad.name])
            pending = [c for c in remaining if c is not bad]
    return results


def _current_case(out: Path, nprocs: int) -> tuple[str | None, float]:
    names, started = [], []
    for r in range(nprocs):
        p = out / f"progress.{r}"
        if p.exists():
            try:
                d = json.loads(p.read_text())
            except json.JSONDecodeError:
                continue
            names.append(d["case"])
            started.append(d["t"])
    name = next((n for n in names if n), None)
    return name, (min(started) if started else time.time())


def _wait(ctx, out: Path, nprocs: int, case_timeout: float, pending: list[Case]) -> tuple[str, str] | None:
    """Join the workers; return (case, message) if the group failed or overran, None on success."""
    launched = time.time()
    last_case, case_start = None, launched
    while True:
        try:
            if ctx.join(timeout=0.5):
                return None
        except ProcessException as e:
            name, _ = _current_case(out, nprocs)
            name = name or (pending[0].name if pending else "?")
            # the first error written is the cause; ranks that failed because of it write theirs later
            errs = sorted(out.glob(f"{name}.error.*"), key=lambda p: p.stat().st_mtime_ns)
            detail = errs[0].read_text() if errs else str(e)
            # a rank that a signal killed (a native crash) writes no error of its own, and its peers'
            # "connection closed" come first; look before _kill's own signals
            killed = [(r, p.exitcode) for r, p in enumerate(ctx.processes) if (p.exitcode or 0) < 0]
            _kill(ctx)
            if killed:
                rank, code = killed[0]
                return name, (
                    f"worker failed in case {name}: rank {rank} was killed by {signal.Signals(-code).name} "
                    f"(its output above says why)\n{detail}"
                )
            return (
                name,
                f"worker failed in case {name}: {detail.strip().splitlines()[-1] if detail.strip() else e}\n{detail}",
            )
        name, t = _current_case(out, nprocs)
        errs = sorted(out.glob("*.error.*"), key=lambda p: p.stat().st_mtime_ns)
        if errs and time.time() - errs[0].stat().st_mtime > 2.0:
            # a rank failed but its process lives on (device threads: the others wait for it); the
            # grace period lets a process that is exiting anyway report through join()
            _kill(ctx)
            failed = errs[0].name.split(".error.")[0]
            detail = errs[0].read_text().strip()
            return failed, f"worker failed in case {failed}: {detail.splitlines()[-1] if detail else '?'}\n{detail}"
        if name != last_case:
            last_case, case_start = name, time.time()
        # start-up (imports, process group) counts against the first case's deadline too
        if time.time() - case_start > case_timeout:
            _kill(ctx)
            name = name or (pending[0].name if pending else "?")
            return name, f"case {name} did not finish within {case_timeout:g}s (timeout); the workers were killed"


def _kill(ctx) -> None:
    """Kill the workers and everything they started (xmp.spawn's device process outlives its parent)."""
    import psutil

    for p in ctx.processes:
        if p.is_alive():
            try:
                children = psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                children = []
            for c in children:
                try:
                    c.kill()
                except psutil.Error:
                    pass
            p.kill()
    for p in ctx.processes:
        p.join(5)
