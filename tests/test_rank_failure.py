"""A rank that dies or stops mid-training ends the others with a clear error, within the timeout.

Two real gloo ranks train an MLP sharded by ``shardcore.shard``; the test kills (SIGKILL) or stops
(SIGSTOP) one of them after a few steps and checks that the survivor exits non-zero, naming the lost
rank, well within the config's ``timeout``, instead of hanging. Also: a script-made process group
that disagrees with the launcher's WORLD_SIZE is refused.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch.distributed as dist

import shardcore
from shardcore_conformance.models import MLP

import harness


def _start_ranks(timeout_s: float) -> list[subprocess.Popen]:
    return harness.start_ranks(2, harness.worker("rank_failure"), str(timeout_s))


def _wait_for_step(proc: subprocess.Popen, step: int, deadline_s: float) -> None:
    t0 = time.time()
    while time.time() - t0 < deadline_s:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"rank exited before training step {step}: {proc.stderr.read()[-3000:]}")
        if line.strip() == f"step {step}":
            return
    pytest.fail(f"no training step {step} within {deadline_s}s")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "victim, sig, timeout_s, expect",
    [
        (1, signal.SIGKILL, 30, "lost rank 1"),
        (0, signal.SIGKILL, 30, "lost rank 0"),  # rank 0 also hosts the rendezvous store
        (1, signal.SIGSTOP, 4, "rank 1 (pid {pid}) is stopped"),  # alive but silent: gloo's timeout bounds it
    ],
    ids=["kill-rank1", "kill-rank0", "stop-rank1"],
)
def test_lost_rank_ends_the_survivor_with_a_clear_error(tmp_path, victim, sig, timeout_s, expect):
    procs = _start_ranks(timeout_s)
    survivor = procs[1 - victim]
    try:
        _wait_for_step(procs[victim], 3, deadline_s=120)
        procs[victim].send_signal(sig)
        t0 = time.time()
        try:
            _, err = survivor.communicate(timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {1 - victim} still running {timeout_s + 30}s after rank {victim} got {sig.name}: a hang")
        elapsed = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
            p.communicate(timeout=30)
    assert survivor.returncode != 0
    assert "shardcore.errors.DistributedSetupError" in err, err[-3000:]
    assert expect.format(pid=procs[victim].pid) in err, err[-3000:]
    assert f"failed on rank {1 - victim} of 2" in err
    # within the configured timeout (plus the slack of a busy 2-core machine), not after it
    assert elapsed < timeout_s + 15, elapsed


@pytest.fixture
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def test_process_group_that_disagrees_with_world_size_is_refused(one_rank_group, monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(shardcore.DistributedSetupError, match=r"world size 1 but the launcher's WORLD_SIZE=2"):
        shardcore.shard(MLP(), {})
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(shardcore.DistributedSetupError, match=r"rank 0 but the launcher's RANK=3"):
        shardcore.shard(MLP(), {})
    monkeypatch.setenv("RANK", "0")
    assert shardcore.handle(shardcore.shard(MLP(), {})).world().size == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting, wrapped", [(None, True), ("0", False)])
def test_the_excepthook_can_be_left_alone(setting, wrapped):
    """shard() wraps sys.excepthook on several ranks (to name a lost rank); SHARDCORE_EXCEPTHOOK=0 opts out."""
    env = harness.clean_env(**({"SHARDCORE_EXCEPTHOOK": setting} if setting else {}))
    out = harness.torchrun(2, harness.worker("excepthook"), env=env, timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
    assert out.stdout.count(f"excepthook wrapped: {wrapped}") == 2, out.stdout
