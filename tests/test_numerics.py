"""One verdict on every x86 CPU: why the conformance tolerances hold whatever the machine's ISA.

Two correct fp32 implementations of a step (eager ATen vs XLA:CPU, AVX2 vs AVX-512 or SSE4.2 kernels,
a reduce-scatter vs one local sum) differ in each gradient entry by rounding, at most
``GRADIENT_ROUNDING``. AdamW turns a gradient difference dg on an entry near zero into a parameter
difference of up to lr * dg / eps, so ``ADAM_EPS`` decides whether that rounding stays far inside
the tolerance or decides the verdict (at eps 1e-6 GPT-2 failed on an AVX2-only CPU and passed on an
AVX-512 one). These tests pin each link: the measured rounding, the optimizer's amplification, and
the verdict itself with the CPU capped to another ISA, broken backends still caught.
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


@pytest.mark.multiprocess
@pytest.mark.xla
def test_gradient_rounding_between_implementations_is_what_the_tolerances_assume(tmp_path):
    """Eager CPU and one XLA:CPU device, each at the native ISA and capped to SSE4.2: every pair of the
    four differs by at most GRADIENT_ROUNDING in every gradient entry of every model. Capping must
    change the numbers, or this would compare a setting with itself."""
    runs = {}
    for setting, extra in (("native", {}), ("capped", harness.CAPPED_ISA)):
        path = tmp_path / f"{setting}.pt"
        out = harness.python(harness.worker("gradient_noise"), path, env=harness.xla_env(1, **extra), timeout=300)
        assert out.returncode == 0, harness.tail(out.stdout, out.stderr)
        for key, grads in torch.load(path, weights_only=True).items():
            runs[f"{key}/{setting}"] = grads
    labels = sorted(runs)
    worst, changed = {}, 0
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            if a.split("/")[0] != b.split("/")[0]:
                continue  # another model
            d = max(float((runs[a][k] - runs[b][k]).abs().max()) for k in runs[a])
            worst[(a, b)] = d
            if a.rsplit("/", 1)[0] == b.rsplit("/", 1)[0]:  # one implementation, native vs capped
                changed += sum(int((runs[a][k] != runs[b][k]).sum()) for k in runs[a])
    assert changed, "capping the ISA changed no gradient entry: the capped setting is not in effect"
    (a, b), d = max(worst.items(), key=lambda kv: kv[1])
    assert d <= GRADIENT_ROUNDING, f"{a} vs {b}: a gradient entry differs by {d:.3g} > {GRADIENT_ROUNDING:g}"


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
