"""What the checkpoint test files share: running a checkpoint worker (``tests/workers/ckpt_*.py``)
under torchrun with a deadline, the tiny Llama they train, and comparing states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardcore_conformance.models import tiny_llama_config

import harness

DEADLINE = 240.0


def command(nproc: int, worker: str, *args: str) -> list[str]:
    """torchrun's command line for ``workers/<worker>.py args`` on ``nproc`` ranks."""
    script = harness.worker(worker)
    return [str(harness.BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), str(script), *args]


def torchrun(nproc: int, worker: str, *args: str, timeout: float = DEADLINE) -> None:
    """Run ``workers/<worker>.py`` on ``nproc`` ranks (torchrun's variables, forks of a zygote:
    ``harness.ranks``); a failure or a hang past ``timeout`` fails the test."""
    proc = harness.ranks(nproc, harness.worker(worker), *args, timeout=timeout)
    if proc.returncode != 0:
        text = proc.stdout
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
        pytest.fail(
            f"workers/{worker}.py {' '.join(args)} on {nproc} ranks failed (rc {proc.returncode}):\n"
            + "\n".join(errors[-15:])
            + "\n"
            + harness.tail(text)
        )


def llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True, **overrides))


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by {float((got[k] - want[k]).abs().max()):.3g}"


def load_pt(path: Path):
    return torch.load(path, weights_only=True)


# -- kill chains under a CheckpointManager (workers/ckpt_manager.py, workers/xla_manager_kill.py) --

#: the workers' schedule: STEPS steps, a save every EVERY
KILL_STEPS, KILL_EVERY = 6, 2
#: ckpt_manager.PHASES, in the order a save meets them
KILL_PHASES = ("train", "staging", "rank_state", "model_commit", "marker", "rename", "retention")


def expected_step(point: str) -> int:
    """The newest step whose save completed before the kill at ``phase:step:who`` (0: none)."""
    phase, step, _ = point.split(":")
    step = int(step)
    if phase == "train":
        return step - step % KILL_EVERY
    return step if phase == "retention" else step - KILL_EVERY


def allowed_steps(point: str, saves: str) -> set[int]:
    """The steps restore may choose after the kill. An async save of the step before a kill in
    training may still have been in flight: then the one before it is the newest complete. Everywhere
    else the newest complete step is known."""
    expected = expected_step(point)
    if saves == "async" and point.startswith("train"):
        return {expected, max(expected - KILL_EVERY, 0)}
    return {expected}


def kill_order(point: str) -> tuple[int, int, int]:
    """Where a point falls in a job: a save's phases at step s come before the training of step s."""
    phase, step, _ = point.split(":")
    return int(step), phase == "train", KILL_PHASES.index(phase)


def newest_step(d: Path) -> int:
    """The step ``restore`` would choose in ``d/ckpt`` (0: none)."""
    from shardcore.checkpoint.manager import CheckpointManager

    latest = CheckpointManager(d / "ckpt").latest()
    return latest[0] if latest else 0


def kill_chain(job, d: Path, points: list[str], saves: str, ranks: int) -> dict:
    """One job, killed at each of ``points`` in turn (``job(d, point)``: each restart resumes, then
    dies at the next point), then run to the end (``job(d)``). After each kill, ``restore`` would
    choose the newest step whose save completed, and the next run's ``ranks`` (each prints
    ``restored step N``) load it. Returns the last run's ``result.pt``."""
    newest = 0
    for point in sorted(points, key=kill_order):
        killed = job(d, point)
        assert killed.returncode != 0 and "never came" not in killed.stdout, f"{point}:\n{killed.stdout[-3000:]}"
        # every rank loaded the step the kill before left as the newest complete one
        assert _restored(killed.stdout, newest) == ranks, f"{point}:\n{killed.stdout[-3000:]}"
        newest, allowed = newest_step(d), allowed_steps(point, saves)
        assert newest in allowed, f"after a kill at {point}, restore would choose step {newest}, not {sorted(allowed)}"
    assert not (d / "result.pt").exists()
    resumed = job(d)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert _restored(resumed.stdout, newest) == ranks, resumed.stdout[-3000:]
    got = load_pt(d / "result.pt")
    assert got["resumed"] == newest
    return got


def _restored(out: str, step: int) -> int:
    """How many ranks said they restored ``step`` (the ranks' lines may interleave)."""
    import re

    return len(re.findall(rf"rank \d+ restored step {step}(?!\d)", out))
