"""Shared fixtures and markers. Tests that launch processes use ``tests/harness.py``.

Markers (pyproject.toml): ``multiprocess`` launches real worker processes; ``xla`` needs torch_xla and
is skipped, saying so, where it is not installed; ``cuda`` needs a CUDA GPU and is skipped, saying
so, on a machine without one. ``-m 'not multiprocess'`` gives the fast in-process subset (``make
test-fast``); ``process_guard.py`` keeps it in-process: an unmarked test that launches a process
fails collection, or failing that, fails when it launches.
"""

import importlib.util
import os

import pytest

import harness

# pytester: test_process_guard.py runs pytest on small test files to check the guard itself
pytest_plugins = ["pytester", "process_guard", "scheduling"]

# Transformers imports torch_xla whenever it is installed; tests that want XLA run it in their own
# processes, so the test process itself stays plain PyTorch.
os.environ.setdefault("USE_TORCH_XLA", "0")

# XLA:CPU's LLVM back end at -O0, and its older fusion code generator, for every XLA process the
# tests start. On CPU PJRT compiling is most of an XLA run (a 18-case parity run spends 31 s of its
# 55 in 81 compilations, executing takes 0.3 s). -O0 halves it (parity run 97 s -> 64 s). The
# default MLIR fusion emitters build an MLIR context and load its dialects for every compilation;
# without them the XLA tests took 387 CPU-s instead of 716. The HLO the suite checks is the same;
# only the machine code differs, as it does between CPUs, which the tolerances already cover
# (docs/numerics.md). `make conformance-xla` and users' runs keep XLA's default.
os.environ["XLA_FLAGS"] = harness.xla_flags(os.environ.get("XLA_FLAGS", ""))

# Inductor compiles in the compiling process. With 2 or more cores it would start a pool of compile
# workers in each process that compiles, a fresh interpreter importing torch (some 3 s of CPU) to
# compile a few tiny kernels; the kernels it writes are the same either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Before its first CPU kernel, Inductor checks each vector ISA the CPU reports by loading a test
# library in a fresh interpreter that imports torch (torch/_inductor/cpu_vec_isa.py), in every
# process that compiles: about 2 CPU-s each. Set to 1, it trusts /proc/cpuinfo's flags for AVX2 and
# AVX-512 and picks the same ISA, so the same kernels. Its AVX-512 BF16 check still runs (torch
# 2.9 does not ask this setting): 3 such interpreters per compiling rank here became 1.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    skips = {}
    if importlib.util.find_spec("torch_xla") is None:
        skips["xla"] = pytest.mark.skip(
            reason="needs torch_xla (pip install torch==2.9.0 torch_xla==2.9.0); not installed here"
        )
    if not torch.cuda.is_available():
        skips["cuda"] = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none on this machine")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """shard() joins a one-rank process group where the script has none; left behind by one in-process
    test, it would be the next test's group, and ``shardcore plan`` refuses to run inside a group."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def mlp():
    """The conformance suite's small MLP (uneven layer sizes), seeded."""
    import torch

    from shardcore_conformance.models import MLP

    torch.manual_seed(0)
    return MLP()


@pytest.fixture
def tiny_llama():
    """A 2-layer Llama built from a config (never downloaded), seeded: a real Hugging Face model
    with ``_no_split_modules``."""
    from shardcore_conformance.models import build_model

    return build_model("llama", seed=0)
