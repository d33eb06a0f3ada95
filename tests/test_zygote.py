"""Programs forked from a zygote (shardcore_conformance/zygote.py) behave as fresh interpreters do:
the test harness runs XLA programs that way, and the conformance runner its XLA workers."""

import json
import os
import signal
import sys

import pytest
import torch

import harness

pytestmark = pytest.mark.multiprocess

PROGRAM = """
import atexit, json, multiprocessing as mp, os, random, sys

def child(q):
    q.put(os.getpid())

def frozen(q):
    import gc
    q.put(gc.get_freeze_count())

if __name__ == "__main__":
    atexit.register(lambda: print("atexit ran", flush=True))
    print("to stderr", file=sys.stderr)
    what = sys.argv[1]
    if what == "spawn":  # multiprocessing's spawn re-imports __main__ from this file
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print(json.dumps({"child": q.get(timeout=60)}))
        p.join()
        sys.exit(p.exitcode)
    if what == "raise":
        raise ValueError("boom")
    if what == "abort":  # as glibc does on a corrupted heap
        def crash_here():
            os.abort()
        crash_here()
    if what == "devices":  # the CPU runtime starts in the fork, with the fork's settings
        import torch_xla.runtime as xr
        print(json.dumps({"devices": xr.global_runtime_device_count(), "zygote": os.getppid()}))
        sys.exit(0)
    if what == "rank":  # as torchrun's ranks: rank 1 fails, rank 0 would wait for it forever
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
        if os.environ["RANK"] == "1":
            sys.exit(3)
        what = "sleep"
    if what == "nested":  # a fork starts a program of its own environment: a fork of the same zygote
        from shardcore_conformance import zygote
        from shardcore_conformance.launch import worker_start_method
        r, w = os.pipe()
        z = zygote.shared().get(dict(os.environ))
        child = z.start([__file__, "report", "0"], env=dict(os.environ), cwd=os.getcwd(), stdout=w, stderr=2)
        os.close(w)
        report = json.loads(os.fdopen(r).readline())
        print(json.dumps({
            "zygote": os.getppid(), "child_zygote": report["zygote"], "status": child.wait(60),
            "workers": worker_start_method("fsdp2", False, {}),
        }))
        sys.exit(0)
    if what == "frozen":  # how many objects the cycle collector skips here and in a fork server's worker
        import gc
        from shardcore_conformance.launch import cpu_fork_method
        assert cpu_fork_method({}) == "forkserver"
        ctx = mp.get_context("forkserver")
        q = ctx.Queue()
        p = ctx.Process(target=frozen, args=(q,))
        p.start()
        print(json.dumps({"zygote": gc.get_freeze_count(), "forkserver": q.get(timeout=120)}))
        p.join()
        sys.exit(p.exitcode)
    if what == "orphan":  # a fork that dies leaves a sleeping fork of its own behind
        from shardcore_conformance import zygote
        z = zygote.shared().get(dict(os.environ))
        child = z.start([__file__, "sleep"], env=dict(os.environ), cwd=os.getcwd(), stdout=1, stderr=2)
        print(json.dumps({"child": child.pid}), flush=True)
        os._exit(0)
    if what == "sleep":
        import time
        time.sleep(600)
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
        "file": __file__, "random": random.random(), "env": os.environ.get("ZYGOTE_TEST"),
        "run": os.environ.get("SHARDCORE_ZYGOTE_RUN"), "zygote": os.getppid(),
        "sid": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(), "xla_flags": os.environ["XLA_FLAGS"],
    }))
    sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("zygote") / "program.py"
    path.write_text(PROGRAM)
    return path


def env(**extra):
    return harness.xla_env(1, ZYGOTE_TEST="yes", **extra)


def test_a_forked_program_sees_what_a_fresh_interpreter_would(program, tmp_path):
    cmd = [sys.executable, program, "report", "3"]
    assert harness.forked(cmd, env())
    runs = [harness.run(cmd, env=env(SHARDCORE_ZYGOTE_RUN=str(i)), cwd=tmp_path, timeout=120) for i in range(2)]
    got = [json.loads(r.stdout.strip().splitlines()[0]) for r in runs]
    for r, g in zip(runs, got):
        assert r.returncode == 3, harness.tail(r.stdout, r.stderr)
        assert r.stderr.strip() == "to stderr" and r.stdout.strip().endswith("atexit ran"), r
        assert g["argv"] == [str(program), "report", "3"] and g["name"] == "__main__", g
        assert g["cwd"] == str(tmp_path) and g["path0"] == str(program.parent) and g["file"] == str(program), g
        assert g["env"] == "yes" and g["sid"] and g["stdin"] == "", g
    assert got[0]["random"] != got[1]["random"]  # each fork seeds as a new interpreter does
    # one zygote served both (SHARDCORE_* is read by no import), and each ran in its own environment
    assert got[0]["zygote"] == got[1]["zygote"] and [g["run"] for g in got] == ["0", "1"], got
    # what torch_xla's import adds to the environment stays, as in a fresh interpreter that imported it
    # (without it XLA:CPU compiles with fast math)
    for g in got:
        assert "--xla_cpu_enable_fast_math=false" in g["xla_flags"].split(), g
        assert set(env()["XLA_FLAGS"].split()) <= set(g["xla_flags"].split()), g


def test_one_zygote_serves_xla_on_every_cpu_device_count(program):
    """torch_xla reads CPU_NUM_DEVICES, PJRT_CPU_ASYNC_CLIENT and XLA_THREAD_POOL_SIZE when its
    runtime starts, never at import: one zygote serves 1, 2 and 4 devices, each fork its own count."""
    cmd = [sys.executable, program, "devices"]
    runs = [
        harness.run(
            cmd, env=harness.xla_env(n, ZYGOTE_TEST="yes", XLA_THREAD_POOL_SIZE=str(2 * n), PJRT_CPU_ASYNC_CLIENT="0")
        )
        for n in (1, 2, 4)
    ]
    got = [json.loads(r.stdout.strip().splitlines()[0]) for r in runs]
    assert [g["devices"] for g in got] == [1, 2, 4], got
    assert len({g["zygote"] for g in got}) == 1, got


def test_a_forked_program_that_raises_exits_1_with_its_traceback(program):
    r = harness.run([sys.executable, program, "raise"], env=env(), timeout=120)
    assert r.returncode == 1 and "ValueError: boom" in r.stderr and "atexit ran" in r.stdout, r


def test_a_forked_program_that_crashes_in_native_code_prints_where_python_was(program):
    """A rank that glibc aborts prints one line of its own; the fork prints its Python stack too
    (faulthandler), and the harness's failure message puts the crash line first."""
    r = harness.run([sys.executable, program, "abort"], env=env(), timeout=120)
    assert r.returncode == -signal.SIGABRT, harness.tail(r.stdout, r.stderr)
    assert "Fatal Python error: Aborted" in r.stderr and "in crash_here" in r.stderr, r.stderr
    assert harness.tail(r.stdout, r.stderr).startswith("crashed in native code:\nFatal Python error: Aborted")


def test_a_forked_program_can_spawn_processes(program):
    r = harness.run([sys.executable, program, "spawn"], env=env(), timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])["child"] > 0, harness.tail(r.stdout, r.stderr)


def test_a_forked_program_past_its_deadline_is_killed(program):
    with pytest.raises(pytest.fail.Exception, match="did not finish within 3s"):
        harness.run([sys.executable, program, "sleep"], env=env(), timeout=3)


def test_the_deadline_kill_reaches_a_program_before_its_setsid():
    """A zygote's fork is returned before it calls setsid(); until then no process group has its
    pid, and a kill of the group alone missed it (on a busy machine, one slept on past the kill).
    Here a process that never leads a group of its own stands in for it."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert os.getpgid(proc.pid) != proc.pid
        harness.kill_group(proc)
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_a_fork_starts_programs_and_cpu_workers_as_forks_of_its_own_zygote(program):
    """A CLI the harness forks (``shardcore-conformance``) starts its CPU workers as forks of the same
    zygote, not through a fork server that would import everything again."""
    plain = harness.clean_env(ZYGOTE_TEST="yes")
    r = harness.run([sys.executable, program, "nested"], env=plain, timeout=120)
    assert r.returncode == 0, harness.tail(r.stdout, r.stderr)
    got = json.loads(r.stdout.splitlines()[0])
    assert got["child_zygote"] == got["zygote"] and got["status"] == 0, got
    assert got["workers"] == "zygote", got


def test_a_forks_collector_skips_what_its_server_imported(program):
    """A zygote and the conformance runner's fork server freeze what their imports created
    (``zygote.freeze_imports``). A full collection in their forks then scans only what the program
    made, not the ~490k objects of torch and Transformers: torch_xla's XLA FSDP runs one per unit."""
    r = harness.run([sys.executable, program, "frozen"], env=harness.clean_env(ZYGOTE_TEST="yes"), timeout=120)
    assert r.returncode == 0, harness.tail(r.stdout, r.stderr)
    got = json.loads(r.stdout.splitlines()[0])
    assert got["zygote"] > 100_000 and got["forkserver"] > 100_000, got


def test_a_forks_own_forks_die_with_it(program):
    """What a fork started and left running is killed once that fork is gone: a CLI killed at the
    harness's deadline takes its workers with it, though they are the zygote's children."""
    import time

    import psutil

    r = harness.run([sys.executable, program, "orphan"], env=harness.clean_env(ZYGOTE_TEST="yes"), timeout=120)
    assert r.returncode == 0, harness.tail(r.stdout, r.stderr)
    pid = json.loads(r.stdout.splitlines()[0])["child"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the orphaned fork {pid} still runs 30 s after the fork that started it exited")


@pytest.mark.xla
def test_xla_workers_forked_from_a_zygote_train_as_spawned_ones_do():
    """The conformance runner's XLA workers on CPU devices are a zygote's forks; a spawned (fresh)
    worker trains the same cases to the same bits."""
    from shardcore_conformance import Case
    from shardcore_conformance.launch import run_cases, worker_start_method

    assert worker_start_method("xla", False, {"PJRT_DEVICE": "CPU"}) == "zygote"
    assert worker_start_method("xla", True, {"PJRT_DEVICE": "TPU"}) == "spawn"
    cases = [Case("xla-fsdp-mlp", "mlp", {"xla": True})]
    forked = run_cases(cases, "xla", 2, 300)
    fresh = run_cases(cases, "xla", 2, 300, start_method="spawn")
    for c in cases:
        assert "error" not in forked[c.name] and "error" not in fresh[c.name], (forked[c.name], fresh[c.name])
        assert forked[c.name]["losses"] == fresh[c.name]["losses"], c.name
        for k, v in fresh[c.name]["params"].items():
            assert torch.equal(forked[c.name]["params"][k], v), (c.name, k)


def test_ranks_are_killed_once_one_fails_as_under_torchrun(program):
    """harness.ranks: torchrun's variables per rank, one output stream, the survivors killed as
    soon as one rank fails (rank 0 sleeps 600 s: waited for, it would overrun the deadline and fail
    the test), and its exit status."""
    r = harness.ranks(2, program, "rank", timeout=120)
    assert r.returncode == 3, harness.tail(r.stdout)
    assert "rank 0 of 2" in r.stdout and "rank 1 of 2" in r.stdout, r.stdout
