"""The backend-neutral training loop: shardcore.clip_grad_norm_, no_sync, launch and the handle's
per-rank helpers; the demo (one file) on FSDP2, XLA FSDP and SPMD; the Trainer's clipping; exits."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys

import pytest
import torch
from torch import nn

import shardcore
from shardcore import ShardcoreError

import harness
from harness import BIN, ROOT

# -- unit level ------------------------------------------------------------------------------


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 3))
    m[3].weight.requires_grad_(False)  # frozen
    m(torch.randn(5, 6))[:, :2].pow(2).sum().backward()
    m[2].bias.grad = None  # a trainable parameter without a gradient
    return m


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), "inf"])
def test_clip_on_an_unsharded_model_is_torchs(norm_type):
    a, b = _model_with_grads(), _model_with_grads()
    got = shardcore.clip_grad_norm_(a, 0.01, norm_type)
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01, norm_type)
    assert torch.equal(got, want) and got > 0.01
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize(
    "max_norm, norm_type, fragment",
    [
        ("big", 2.0, "max_norm='big'"),
        (1.0, "fro", "norm_type='fro'"),
        (-1.0, 2.0, "max_norm=-1.0"),
        (1.0, 0, "norm_type=0.0"),
    ],
)
def test_clip_arguments_are_checked(max_norm, norm_type, fragment):
    with pytest.raises(ShardcoreError, match=re.escape(fragment)):
        shardcore.clip_grad_norm_(_model_with_grads(), max_norm, norm_type)


def test_clip_on_a_backend_without_it_is_a_clear_error():
    from backends_for_tests import PlainBackend

    model = shardcore.shard(nn.Linear(4, 4), {"auto_wrap_policy": "NO_WRAP"}, backend=PlainBackend())
    with pytest.raises(
        ShardcoreError, match=r"'plain' backend does not implement gradient clipping.*clip_grad_norm_\(model"
    ):
        shardcore.clip_grad_norm_(model, 1.0)
    with shardcore.no_sync(model):  # without the capability: gradients reduced every micro-batch
        pass


def test_handle_loop_surface_on_one_rank():
    from backends_for_tests import PlainBackend

    sc = shardcore.handle(shardcore.shard(nn.Linear(4, 4), {"auto_wrap_policy": "NO_WRAP"}, backend=PlainBackend()))
    assert (sc.rank, sc.world_size, sc.is_main_process) == (0, 1, True)
    batch = sc.local_batch({"x": torch.ones(4, 2)})
    assert batch["x"].shape == (4, 2)
    sc.step_end()  # no StepEnd capability: a no-op
    assert float(sc.reduce(torch.tensor(3.0))) == 3.0 and float(sc.reduce(torch.tensor(3.0), "sum")) == 3.0
    with pytest.raises(ShardcoreError, match="reduction='max'"):
        sc.reduce(torch.tensor(1.0), "max")
    sc.barrier()


# -- real runs -------------------------------------------------------------------------------

_ROW = re.compile(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.]+)\s+([\d.]+)$", re.M)


def _demo(cmd: list[str], env: dict, config: str | None) -> tuple[str, list[tuple[float, ...]]]:
    args = [str(ROOT / "examples" / "demo.py"), "--steps", "4"] + (
        ["--config", str(ROOT / "examples" / "configs" / config)] if config else []
    )
    out = harness.run(cmd + args, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = [tuple(float(x) for x in r[1:]) for r in _ROW.findall(out.stdout)]
    return out.stdout, rows


def _first_single_device_loss() -> float:
    """The demo's single-device loss at its first step, from its seeded model, in this process."""
    spec = importlib.util.spec_from_file_location("shardcore_demo", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    args = demo.parse_args(["--steps", "1"])
    losses, _ = demo.train(demo.build(), demo.batches(args.steps, args.global_batch), args)
    return losses[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backend",
    ["fsdp2", pytest.param("xla_fsdp", marks=pytest.mark.xla), pytest.param("xla_spmd", marks=pytest.mark.xla)],
)
def test_demo_runs_unchanged_on_every_backend(backend):
    """examples/demo.py, one file: clipping and accumulation through the public surface only, on
    torchrun + FSDP2 (2 ranks), XLA FSDP (2 CPU devices, xmp.spawn) and SPMD (2 CPU devices)."""
    if backend == "fsdp2":
        stdout, rows = _demo([BIN / "torchrun", "--standalone", "--nproc_per_node", "2"], harness.clean_env(), None)
        assert "fsdp2 on 2 rank(s) (cpu)" in stdout
    else:
        stdout, rows = _demo([sys.executable], harness.xla_env(2), f"{backend}.json")
        assert ("xla on 2 rank(s)" if backend == "xla_fsdp" else "xla on 1 rank(s)") in stdout
    assert "grad_accum 2, max_grad_norm 1.0" in stdout
    assert len(rows) == 4
    # the seeded model on every backend: XLA FSDP's device threads once built it at the same time
    # from torch's one generator, and the draw, so each verdict, changed from run to run
    assert abs(rows[0][1] - _first_single_device_loss()) <= 1e-6, rows[0]
    for sharded, single, diff, norm, single_norm in rows:
        assert abs(sharded - single) <= 1e-5 and abs(norm - single_norm) <= 1e-5 * single_norm
    assert any(norm > 1.0 for *_, norm, _ in rows), "clipping never engaged: the demo would not test it"
    assert rows[-1][0] < rows[0][0]  # it trains


@pytest.mark.multiprocess
def test_demo_fails_on_a_parity_mismatch():
    """The demo's own check can fail: with a tolerance of 0 and accumulation over several ranks the
    sums differ in the last bits."""
    out = harness.torchrun(2, ROOT / "examples" / "demo.py", "--steps", "3", "--tolerance", "-1", timeout=300)
    assert out.returncode != 0 and "FAIL: the sharded run differs" in out.stdout


@pytest.mark.multiprocess
def test_clipping_and_accumulation_match_the_trainer(tmp_path):
    """max_grad_norm=1.0 with 2 accumulation steps: the Transformers Trainer (one CPU process) and
    shardcore's loop on 2 FSDP2 ranks log the same loss and gradient norm at every step."""
    worker = harness.worker("loop")
    ref, got = tmp_path / "trainer.json", tmp_path / "shardcore.json"
    out = harness.python(worker, "trainer", str(ref), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    out = harness.ranks(2, worker, "shardcore", str(got), timeout=300)
    assert out.returncode == 0, harness.tail(out.stdout)
    ref, got = json.loads(ref.read_text()), json.loads(got.read_text())
    assert len(ref["losses"]) == len(got["losses"]) == 4
    assert all(n > 1.0 for n in ref["grad_norms"]), ref  # the Trainer clipped at every step
    for a, b in zip(ref["losses"], got["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (ref, got)
    for a, b in zip(ref["grad_norms"], got["grad_norms"]):
        assert math.isclose(a, b, rel_tol=1e-5), (ref, got)


@pytest.mark.multiprocess
@pytest.mark.parametrize("owner, alive", [("shardcore", False), ("script", True)])
def test_process_group_teardown_at_exit(tmp_path, owner, alive):
    """A process group that shard() created is destroyed at exit (left to static destruction, gloo
    can kill a finished rank with SIGABRT); a group the script created is the script's to destroy."""
    out = harness.torchrun(2, harness.worker("exit_check"), owner, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for r in (0, 1):
        assert f"rank {r} group alive at exit: {alive}" in out.stdout, out.stdout
