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
            + text[-3000:]
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
