"""Fault injection on FSDP2 ranks: a real 2-rank training job under a CheckpointManager is killed
(SIGKILL, one rank or every rank) at chosen points of training and of a save, then restarted. The
restarted job must resume from the newest step whose save completed and end bit for bit where an
uninterrupted job ends (fp32), for both checkpoint formats. And a SIGTERM to one rank (preemption)
makes every rank save at the next step and stop.
"""

from __future__ import annotations

import random

import pytest
import torch

from shardcore.checkpoint import manager as mgr

import harness
from ckpt_helpers import kill_chain, load_pt, newest_step

pytestmark = pytest.mark.multiprocess

STEPS, EVERY = 6, 2  # as in workers/ckpt_manager.py
KINDS = ["FULL_STATE_DICT", "SHARDED_STATE_DICT"]
#: phase -> (steps, ranks) where a kill can land (workers/ckpt_manager.py's PHASES)
WHERE = {
    "train": (range(STEPS), ("0", "1", "all")),
    "staging": (range(EVERY, STEPS + 1, EVERY), ("0", "1", "all")),
    "model_commit": (range(EVERY, STEPS + 1, EVERY), ("0",)),
    "rank_state": (range(EVERY, STEPS + 1, EVERY), ("0", "1", "all")),
    "marker": (range(EVERY, STEPS + 1, EVERY), ("0",)),
    "rename": (range(EVERY, STEPS + 1, EVERY), ("0",)),
    "retention": ((STEPS,), ("0",)),  # keep_last=2 deletes first at the third save
}
CHOSEN = [
    "train:1:0", "train:3:1", "train:5:all",
    "staging:2:0", "staging:4:1", "staging:6:all",
    "model_commit:2:0", "model_commit:4:0", "model_commit:6:0",
    "rank_state:2:1", "rank_state:4:0", "rank_state:6:all",
    "marker:2:0", "marker:4:0", "marker:6:0",
    "rename:2:0", "rename:4:0", "rename:6:0",
    "retention:6:0",
]  # fmt: skip
_ALL = [f"{p}:{s}:{w}" for p, (steps, who) in WHERE.items() for s in steps for w in who]
#: a seeded draw from the points not chosen by hand: the same on every machine and every run
RANDOM = random.Random(41).sample(sorted(set(_ALL) - set(CHOSEN)), 6)


def _job(d, kind, mode, *point, timeout=300):
    return harness.ranks(2, harness.worker("ckpt_manager"), str(d), kind, mode, *point, timeout=timeout)


#: (format, save mode) -> the kill points of one chain: the points chosen by hand in two
#: combinations, the random ones in the other two
CHAINS = {
    ("FULL_STATE_DICT", "sync"): CHOSEN,
    ("SHARDED_STATE_DICT", "async"): CHOSEN,
    ("SHARDED_STATE_DICT", "sync"): RANDOM,
    ("FULL_STATE_DICT", "async"): RANDOM,
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each format's job run through without a kill, once."""
    results = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(f"straight-{kind.split('_')[0].lower()}")
        out = _job(d, kind, "sync")
        assert out.returncode == 0, out.stdout[-3000:]
        results[kind] = load_pt(d / "result.pt")
        assert results[kind]["resumed"] == 0
    return results


@pytest.mark.parametrize("kind, mode", list(CHAINS), ids=[f"{k.split('_')[0].lower()}-{m}" for k, m in CHAINS])
def test_a_job_killed_again_and_again_resumes_each_time_from_the_newest_complete_step(
    tmp_path, uninterrupted, kind, mode
):
    """One job, killed at each point of the chain in turn (each restart resumes, then dies at the
    next point), then run to the end: it must end bit for bit where the uninterrupted job ends."""
    got = kill_chain(lambda d, *point: _job(d, kind, mode, *point), tmp_path, CHAINS[kind, mode], mode, 2)
    want = uninterrupted[kind]
    assert got["lr"] == want["lr"]
    assert got["state"].keys() == want["state"].keys()
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), f"{k} differs after the kills ({kind}, {mode})"
    # the last run's retention left the last two steps, complete, and removed every leftover
    assert [s for s, _ in mgr.CheckpointManager(tmp_path / "ckpt").checkpoints()] == [STEPS - EVERY, STEPS]


@pytest.mark.parametrize("kind, mode", [("FULL_STATE_DICT", "async"), ("SHARDED_STATE_DICT", "sync")])
def test_a_sigterm_on_one_rank_saves_the_next_step_on_every_rank_and_stops(tmp_path, uninterrupted, kind, mode):
    """Preemption: rank 1 alone gets SIGTERM in step 2 (no save due until 4). Every rank saves step 3
    and the job exits 0; the restarted job resumes from step 3 and ends bit for bit."""
    stopped = _job(tmp_path, kind, mode, "sigterm:2:1")
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    assert load_pt(tmp_path / "preempted.pt") == {"step": 3}
    assert newest_step(tmp_path) == 3 and not (tmp_path / "result.pt").exists()
    resumed = _job(tmp_path, kind, mode)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    got, want = load_pt(tmp_path / "result.pt"), uninterrupted[kind]
    assert got["resumed"] == 3 and got["lr"] == want["lr"]
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), f"{k} differs after the preemption ({kind}, {mode})"


def test_fsdp2_gathers_a_full_save_in_the_background_to_the_same_bytes(tmp_path):
    """AsyncFullCheckpoints: each rank's shards copied, then gathered to rank 0 off the loop's
    process group, give what the foreground gather gives, key for key and bit for bit, even after
    the model changed in place in between."""
    out = harness.ranks(2, harness.worker("ckpt_manager"), str(tmp_path), "snapshot", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    assert load_pt(tmp_path / "snapshot.pt")["tensors"] > 20
