"""One verdict on every x86 CPU: why the conformance tolerances hold whatever the machine's ISA.

Two correct fp32 implementations of a step (eager ATen vs XLA:CPU, AVX-512, AVX2 or SSE4.2 kernels,
a reduce-scatter vs one local sum) differ in each gradient entry by rounding. AdamW turns a gradient
difference dg on an entry near zero into a parameter difference of up to lr * dg / eps (on a large
entry its step is sign-like), so ``ADAM_EPS`` decides whether that rounding stays far inside the
tolerance or decides the verdict (at eps 1e-6 GPT-2 failed on an AVX2-only CPU and passed on an
AVX-512 one). These tests pin each link: what AdamW passes on of the measured rounding (at most
``GRADIENT_ROUNDING``), the optimizer's amplification, and the verdict itself with the CPU capped to
another ISA, broken backends still caught.
"""

import pytest
import torch

from shardcore_conformance import Case, run_suite
from shardcore_conformance.compare import GRADIENT_ROUNDING, TOLERANCES
from shardcore_conformance.train import ADAM_EPS

import harness
from xla_helpers import X
from xla_helpers import assert_ok as _assert_ok

#: the largest learning rate of any fp32 case
FP32_LR = Case("probe", "mlp").lr


@pytest.mark.parametrize("grad", [0.0, 1e-9, 1e-7, 1e-6, 1e-5, 1e-3, -0.1])
def test_one_adamw_step_keeps_rounding_within_half_the_tolerance(grad):
    """The worst case is an entry whose gradient is ~0: AdamW's step is then lr * g / (|g| + eps)."""
    bound = FP32_LR * GRADIENT_ROUNDING / ADAM_EPS
    assert bound <= TOLERANCES["fp32"].param_atol / 2, (bound, ADAM_EPS)
    moved = []
    for g in (grad, grad + GRADIENT_ROUNDING):
        p = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        opt = torch.optim.AdamW([p], lr=FP32_LR, weight_decay=0.01, eps=ADAM_EPS)
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        moved.append(float(p))
    assert abs(moved[0] - moved[1]) <= bound * (1 + 1e-9)


def adamw_passed_on(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Of the difference between gradients ``a`` and ``b``, what AdamW's step passes on, in gradient
    units: eps / lr x the parameter difference of one step from fresh state (lr * g / (|g| + eps)).
    It is the gradient difference itself on entries well below eps, where AdamW's gain lr / eps acts,
    and shrinks as eps^2 / g^2 on larger entries, whose step is sign-like whatever their last ulps."""
    return ADAM_EPS * (a / (a.abs() + ADAM_EPS) - b / (b.abs() + ADAM_EPS)).abs()


def test_adamw_passes_on_rounding_near_zero_and_not_on_large_entries():
    dg = torch.tensor([GRADIENT_ROUNDING] * 3, dtype=torch.float64)
    g = torch.tensor([0.0, ADAM_EPS, 0.2], dtype=torch.float64)
    seen = adamw_passed_on(g + dg, g)
    assert seen[0] == pytest.approx(float(dg[0]), rel=1e-2)  # near zero: all of it
    assert seen[1] == pytest.approx(float(dg[1]) / 4, rel=1e-2)  # at eps: (eps / 2 eps)^2
    assert seen[2] < float(dg[2]) * 1e-6  # at 0.2: AdamW's step is sign-like


#: the CPUs the suite's verdict must not depend on, emulated on this one for eager and XLA alike: the
#: machine's own ISA (AVX-512 or AVX2), AVX2, and SSE4.2 (older than any the suite targets)
ISA_SETTINGS = {"native": {}, "avx2": harness.AVX2_ISA, "sse4_2": harness.CAPPED_ISA}


@pytest.mark.multiprocess
@pytest.mark.xla
def test_gradient_rounding_between_implementations_is_what_the_tolerances_assume(tmp_path):
    """Eager CPU and one XLA:CPU device, each at the native ISA, AVX2 and SSE4.2: for every pair of the
    six, what AdamW passes on of the gradient difference stays within GRADIENT_ROUNDING, in every
    entry of every model (the bound lr * GRADIENT_ROUNDING / eps of one step rests on it). Capping
    must change the numbers, or this would compare a setting with itself."""
    runs = {}
    for setting, extra in ISA_SETTINGS.items():
        path = tmp_path / f"{setting}.pt"
        out = harness.python(harness.worker("gradient_noise"), path, env=harness.xla_env(1, **extra), timeout=300)
        assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
        for key, grads in torch.load(path, weights_only=True).items():
            runs[f"{key}/{setting}"] = grads
    labels = sorted(runs)
    worst, largest, changed = {}, 0.0, 0
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            if a.split("/")[0] != b.split("/")[0]:
                continue  # another model
            worst[(a, b)] = max(float(adamw_passed_on(runs[a][k], runs[b][k]).max()) for k in runs[a])
            largest = max(largest, *(float((runs[a][k] - runs[b][k]).abs().max()) for k in runs[a]))
            if a.split("/")[1] == b.split("/")[1] and "sse4_2" in (a.split("/")[2], b.split("/")[2]):
                changed += sum(int((runs[a][k] != runs[b][k]).sum()) for k in runs[a])
    assert changed, "capping the ISA changed no gradient entry: the capped setting is not in effect"
    (a, b), d = max(worst.items(), key=lambda kv: kv[1])
    assert d <= GRADIENT_ROUNDING, (
        f"{a} vs {b}: AdamW passes on a gradient difference of {d:.3g} > {GRADIENT_ROUNDING:g} "
        f"(largest raw difference of any entry: {largest:.3g})"
    )


@pytest.mark.multiprocess
@pytest.mark.xla
def test_verdict_holds_with_the_cpu_isa_capped():
    """GPT-2 at one XLA device, the case whose verdict used to follow the CPU, passes with eager and
    XLA both capped; a broken backend is still caught under the same setting."""
    env = harness.CAPPED_ISA
    good = run_suite([Case("xla-fsdp-gpt2-tied", "gpt2", X, global_batch=4)], "xla", 1, case_timeout=300, env=env)
    _assert_ok(good)
    broken = run_suite(
        [Case("two-outputs", "mlp_two_outputs", X, global_batch=4)],
        "broken_xla_backends:WithoutUnitFixes",
        1,
        case_timeout=300,
        env=env,
    )
    assert not broken.ok and "differs at step 1" in " ".join(broken.verdicts[0].reasons), broken.verdicts[0].reasons
