"""Start Python programs as forks of a process that already imported their heavy modules.

On a small CPU, starting a program that imports torch, torch_xla and Transformers costs 6 to 8 s
of CPU before its first line runs; a test session starts dozens. A zygote is a server process that
imports them once, in the environment its programs will run in, and forks one child per program.
The child is what ``python script args`` would have been: its own session (so a process-group
kill reaches it and what it starts), ``sys.argv``, ``sys.path[0]`` the script's directory,
``__main__`` the script (so ``multiprocessing``'s spawn, e.g. in ``xmp.spawn``, re-imports it),
the caller's working directory and standard streams, fresh random seeds, and the exit status of
a script (atexit handlers run, streams flushed).

torch, torch_xla and Transformers read variables at import (Transformers' ``USE_TORCH_XLA``,
torch_xla's ``XLA_FLAGS`` set-up, ``ATEN_CPU_CAPABILITY``), so a zygote serves only programs of its
own environment: :class:`Zygotes` keeps one per environment, where only variables that no import
reads may differ (:func:`import_env`); the child then runs in exactly the environment asked for.
The runtime itself (XLA's PJRT client, a process group) starts in the child, never in the zygote:
forking a started runtime is unsafe.

A zygote serves one client process and exits when that process is gone.

After its imports a zygote freezes what they created (``gc.freeze()``, :func:`freeze_imports`).
"""

from __future__ import annotations

import array
import atexit
import faulthandler
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: what a program of the test suite or the conformance runner imports before its first line
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "shardcore",
    "shardcore_conformance.train",
)
#: imported besides where the environment asks for torch_xla (PJRT_DEVICE set)
PRELOAD_XLA = (
    "torch_xla",
    "torch_xla.core.xla_model",
    "torch_xla.runtime",
    "torch_xla.distributed.fsdp",
    "torch_xla.distributed.spmd",
    "torch_xla.distributed.xla_multiprocessing",
    "shardcore_xla",
)
_HEADER = struct.Struct("!I")
_INT = struct.Struct("!i")  # a pid or an exit status
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


#: read when a run starts, never at import: pytest's per-test variable, torchrun's rank variables
#: (``init_process_group`` reads them), and torch_xla's CPU runtime settings, which the PJRT client
#: reads when it starts and torch_xla's thread pool when it is first used (a pool started at import
#: would have lost its threads in every fork). So one zygote serves XLA on 1, 2 and 4 CPU devices.
RUNTIME_ONLY = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CPU_NUM_DEVICES",
        "PJRT_CPU_ASYNC_CLIENT",
        "XLA_THREAD_POOL_SIZE",
    }
)


def import_env(env: dict[str, str]) -> dict[str, str]:
    """What of ``env`` an import may read: all but :data:`RUNTIME_ONLY` and shardcore's own
    ``SHARDCORE_*`` variables (read when a run starts)."""
    return {k: v for k, v in env.items() if k not in RUNTIME_ONLY and not k.startswith("SHARDCORE_")}


class ZygoteProcess:
    """A forked program, with the part of ``subprocess.Popen``'s interface the test harness uses."""

    def __init__(self, pid: int, conn: socket.socket, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], 0)
            if ready:
                self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        data = _recv_exact(self._conn, _INT.size)
        # None: the zygote died, and the child's fate is unknown; reported as killed
        self.returncode = -signal.SIGKILL if data is None else _INT.unpack(data)[0]
        self._conn.close()

    def kill(self) -> None:
        # the child itself too: a kill right after the fork may come before its setsid()
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Zygote:
    """One zygote process serving programs in ``env``."""

    #: zygotes this process started, each an interpreter's imports (the test profile counts them)
    started = 0

    def __init__(self, env: dict[str, str], preload: tuple[str, ...]):
        Zygote.started += 1
        self.env = dict(env)
        self.serves = [import_env(env)]
        self._owned = True
        self._dir = tempfile.mkdtemp(prefix="shardcore-zygote-")
        self.address = str(Path(self._dir) / "socket")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardcore_conformance.zygote", self.address, str(os.getpid()), *preload],
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @classmethod
    def attached(cls, address: str, env: dict[str, str], imported_env: dict[str, str]) -> "Zygote":
        """The zygote a fork runs under, serving programs of its environment to that fork in turn: a
        CLI the tests fork starts its workers as the zygote's forks too, not as fresh interpreters.
        ``env`` is what it was started in and ``imported_env`` what its imports left (torch_xla adds
        to ``XLA_FLAGS``), which the fork inherits and passes on: a fresh interpreter started in
        either ends with the same. It is the starter's to close, not the fork's."""
        z = cls.__new__(cls)
        z.env, z.address, z.proc, z._owned, z._dir = dict(env), address, None, False, None
        z.serves = [import_env(env), import_env(imported_env)]
        return z

    def alive(self) -> bool:
        return self.proc.poll() is None if self._owned else os.path.exists(self.address)

    def start(
        self,
        argv: list,
        *,
        env: dict[str, str],
        cwd: str | os.PathLike,
        stdout: int,
        stderr: int,
        path: list[str] | None = None,
    ) -> ZygoteProcess:
        """Fork ``python argv[0] argv[1:]`` in ``env`` (whose :func:`import_env` must be this
        zygote's), with these file descriptors as its stdout and stderr (stdin is /dev/null).
        ``path`` replaces ``sys.path``, as ``multiprocessing``'s spawn gives a child its parent's;
        by default ``sys.path[0]`` is the script's directory, as for ``python script``."""
        if import_env(env) not in self.serves:
            raise ValueError("a zygote forks only programs whose imports see its own environment")
        conn = self._connect()
        request = {"argv": [str(a) for a in argv], "cwd": str(cwd), "env": env, "path": path}
        request = json.dumps(request).encode()
        fds = array.array("i", [stdout, stderr])
        conn.sendmsg([_HEADER.pack(len(request)) + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        pid = _recv_exact(conn, _INT.size)
        if pid is None:
            conn.close()
            status = self.proc.poll() if self._owned else "unknown"
            raise RuntimeError(f"the zygote for {argv[0]} died before forking it (exit status {status})")
        return ZygoteProcess(_INT.unpack(pid)[0], conn, [sys.executable, *map(str, argv)])

    def _connect(self) -> socket.socket:
        # the zygote imports for several seconds before it listens
        deadline = time.monotonic() + 300
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.address)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if not self.alive():
                    status = self.proc.returncode if self._owned else "unknown"
                    raise RuntimeError(f"the zygote exited with status {status} while importing") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("the zygote did not listen within 300 s") from None
                time.sleep(0.05)

    def close(self) -> None:
        if not self._owned:
            return
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for p in (Path(self.address), Path(self._dir)):
            try:
                p.unlink() if p.is_socket() else p.rmdir()
            except OSError:
                pass


class Zygotes:
    """One zygote per environment, started on first use (and again if one died); the least recently
    used is closed beyond ``keep``. Each holds some 450 MB of its own (780 MB resident). A test
    worker meets a few environments (plain, XLA, the numerics test's capped ISAs, a test's own
    variable); with 4 kept and XLA's device counts each an environment of its own, a make-test run
    started 20 zygotes in its first 16% of tests, at 15 s of CPU each."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, keep: int = 8):
        self.preload = preload
        self.keep = keep
        self._zygotes: dict[tuple, Zygote] = {}
        self._lock = threading.Lock()

    def get(self, env: dict[str, str]) -> Zygote:
        """The zygote for ``env``: the one this process was forked from where it serves ``env``."""
        if _parent is not None and import_env(env) in _parent.serves:
            return _parent
        key = tuple(sorted(import_env(env).items()))
        with self._lock:
            z = self._zygotes.pop(key, None)
            if z is None or not z.alive():
                extra = PRELOAD_XLA if env.get("PJRT_DEVICE") else ()
                z = Zygote(env, self.preload + extra)
            self._zygotes[key] = z  # most recent last
            while len(self._zygotes) > self.keep:
                self._zygotes.pop(next(iter(self._zygotes))).close()
            return z

    def close(self) -> None:
        with self._lock:
            for z in self._zygotes.values():
                z.close()
            self._zygotes.clear()


def join_group(procs: list[ZygoteProcess], timeout: float) -> tuple[int, int] | None:
    """Wait up to ``timeout`` seconds for a group of forks (ranks) to end: ``(index, status)`` of the
    first that failed as soon as one has, ``(-1, 0)`` once all exited 0, None if still running."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            return failed
        if all(c == 0 for c in codes):
            return -1, 0
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


_shared: Zygotes | None = None
#: the zygote this process is a fork of (set in the fork), None in a fresh interpreter
_parent: Zygote | None = None


def parent() -> Zygote | None:
    """The zygote this process was forked from, which serves programs of its environment."""
    return _parent


def shared() -> Zygotes:
    """This process's zygotes, closed at its exit (the test harness and the conformance runner)."""
    global _shared
    if _shared is None:
        _shared = Zygotes()
        atexit.register(_shared.close)
    return _shared


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# ------------------------------------------------------------------------------------- server side


def _serve(address: str, client_pid: int, preload: list[str]) -> None:
    started_env = import_env(dict(os.environ))  # what a client asked for, before imports add to it
    for name in preload:
        importlib.import_module(name)
    freeze_imports()
    imported_env = import_env(dict(os.environ))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(16)
    os.rename(address + ".tmp", address)  # clients connect only once it listens
    waiting: dict[int, socket.socket] = {}  # child pid -> its client's connection
    requester: dict[int, int] = {}  # child pid -> the pid that asked for it
    while True:
        ready, _, _ = select.select([listener], [], [], 0.2)
        if ready:
            conn, _ = listener.accept()
            peer = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
            pid = _fork_child(conn, listener, (address, started_env, imported_env))
            conn.sendall(_INT.pack(pid))
            waiting[pid] = conn
            requester[pid] = peer
        _reap(waiting)
        for pid in [p for p in waiting if requester[p] != client_pid and not _alive(requester[p])]:
            # a fork's own forks (a CLI's workers) die with it: nothing else would collect them
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            requester.pop(pid)
        for pid in set(requester) - set(waiting):
            del requester[pid]
        if not _alive(client_pid):
            for pid in waiting:  # the client is gone, and no one will collect these
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return


def freeze_imports() -> None:
    """Keep the cycle collector of this process and of its forks off what was imported so far.

    torch, torch_xla and Transformers leave about 490k objects that live as long as the process.
    A full collection scans them all, about 0.2 s on a small CPU. torch_xla's XLA FSDP runs one for
    each unit it wraps (``gc.collect()`` in ``XlaFullyShardedDataParallel.__init__``), and imports
    and training trigger more: the suite's processes spent minutes of CPU in them. Frozen objects
    are skipped by the collector and still freed by reference counting. CPython documents this for
    a process that forks: it also keeps the collector from writing to the parent's pages."""
    gc.collect()
    gc.freeze()


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(_INT.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _fork_child(conn: socket.socket, listener: socket.socket, itself: tuple) -> int:
    # the descriptors travel with the message's first bytes: a plain recv there would drop them
    msg, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_LEN(2 * 4))
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    while len(msg) < _HEADER.size or len(msg) < _HEADER.size + _HEADER.unpack(msg[: _HEADER.size])[0]:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise RuntimeError("a client hung up in the middle of its request")
        msg += chunk
    request = json.loads(msg[_HEADER.size :])
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        listener.close()
        conn.close()
        os.setsid()
        # the module as the child's code imports it (this one runs as __main__)
        module = importlib.import_module("shardcore_conformance.zygote")
        module._parent = module.Zygote.attached(*itself)
        code = _run_child(request, list(fds))
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run_child(request: dict, fds: list[int]) -> int:
    import atexit
    import random
    import runpy

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    # a crash in native code (glibc's heap checks abort; a segfault) then prints where Python was in
    # every thread; without it a rank's only word is one glibc line, easily lost among its peers' errors
    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    random.seed()  # a fresh interpreter would seed from the OS; a fork shares the zygote's state
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    script = request["argv"][0]
    # Only what no import reads comes from the request: the rest is the zygote's environment as its
    # imports left it, which is what the same imports leave in a fresh interpreter (torch_xla adds
    # --xla_cpu_enable_fast_math=false to XLA_FLAGS at import; dropping it changes XLA:CPU's numerics).
    for k in set(os.environ) - set(import_env(dict(os.environ))):
        del os.environ[k]
    wanted = request["env"]
    os.environ.update({k: v for k, v in wanted.items() if k not in import_env(wanted)})
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    if request.get("path") is not None:
        sys.path[:] = request["path"]
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # what the interpreter does at exit; os._exit follows, which would skip it
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
