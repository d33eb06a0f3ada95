"""The conformance suite as a vendor uses it: the case matrix per backend, the comparison, and the
``shardcore-conformance`` command end to end (report files, broken backends, timeouts, and an
out-of-tree backend package installed and run by its entry-point name).

The command's real runs (new processes) are in test_conformance_cli.py; the full FSDP2 matrix runs
once, through the command, in test_conformance_cli.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import shardcore
from shardcore_conformance import TOLERANCES, compare, covered_keys, fsdp2_matrix, matrix_for
from shardcore_conformance.cli import main as cli_main
from shardcore_conformance.models import build_model


class _Keys:
    """A backend object for matrix tests: only its declared keys matter."""

    def __init__(self, *keys):
        self.supported_keys = frozenset(keys)


XLA_KEYS = (
    "xla",
    "xla_fsdp_v2",
    "xla_fsdp_grad_ckpt",
    "xla_fsdp_settings",
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "min_num_params",
)


# ------------------------------------------------------------------------------ the case matrix


def _check_matrix(cases, keys):
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    for c in cases:
        cfg = shardcore.parse_config(c.config)  # every config is valid
        extra = set(cfg.non_default_keys()) - set(keys)
        assert not extra, f"{c.name} sets {extra}, which the backend does not declare"
        assert c.global_batch % c.grad_accum == 0


def test_fsdp2_matrix_makes_every_supported_key_a_dimension():
    keys = shardcore.get_backend("fsdp2").supported_keys
    cases = fsdp2_matrix()
    _check_matrix(cases, keys)
    assert set(covered_keys(cases)) == set(keys)
    families = {c.family for c in cases}
    assert {
        "mlp",
        "llama",
        "gpt2",
        "frozen",
        "buffers",
        "uneven",
        "grad_accum",
        "lr_schedule",
        "mixed_precision",
        "cpu_offload",
    } <= families
    by_name = {c.name: c for c in cases}
    assert by_name["grad_accum-llama"].grad_accum == 2
    assert by_name["lr_schedule-gpt2"].lr_schedule == "warmup_cosine"
    assert by_name["frozen-llama"].frozen
    # tied GPT-2 never gets a size-based unit (it would hold the embedding shared with the head)
    assert not any(n.startswith("gpt2-size") for n in by_name)
    assert {c.dtype for c in cases} == {"fp32", "bf16"}
    # uneven: some parameter has fewer rows than ranks (empty shards); every model has odd sizes
    uneven = build_model(by_name["uneven-mlp"].model, 0)
    assert min(p.shape[0] for p in uneven.parameters()) == 1
    for model in ("mlp", "llama", "gpt2"):
        assert any(p.shape[0] % 2 for p in build_model(model, 0).parameters()), model


def test_fewer_keys_give_fewer_cases():
    full = fsdp2_matrix()
    wrap_only = matrix_for("backends_for_tests:OnlyWrapBackend")
    bare = matrix_for(_Keys())
    _check_matrix(wrap_only, {"auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params"})
    _check_matrix(bare, set())
    assert len(bare) < len(wrap_only) < len(full)
    assert all(c.config == {} for c in bare)
    # the features every backend must get right are there even with no key at all
    assert {c.family for c in bare} >= {"frozen", "buffers", "uneven", "grad_accum", "lr_schedule"}
    with pytest.raises(ValueError, match="neither 'mixed_precision' nor 'xla_fsdp_settings'"):
        matrix_for(_Keys(), dtype="bf16")


def test_xla_matrix_from_xla_keys():
    cases = matrix_for(_Keys(*XLA_KEYS), world_size=4)
    _check_matrix(cases, XLA_KEYS)
    assert all(c.config.get("xla") is True and c.global_batch == 16 for c in cases)
    v2 = {c.config.get("xla_fsdp_v2") for c in cases if c.family == "llama"}
    assert v2 == {True, False}
    for c in cases:
        if c.config.get("xla_fsdp_grad_ckpt"):
            assert c.config.get("auto_wrap_policy") != "NO_WRAP", c.name
    # bf16 through compute_dtype; the mixed-dtype LoRA case's bf16 is its base's own (SPMD only)
    (mixed,) = [c for c in cases if c.model == "llama_lora_mixed"]
    assert mixed.dtype == "bf16" and mixed.config["xla_fsdp_v2"] is True
    bf16 = [c for c in cases if c.dtype == "bf16" and c is not mixed]
    assert bf16 and all(c.config["xla_fsdp_settings"] == {"compute_dtype": "bfloat16"} for c in bf16)
    assert not any("mixed_precision" in c.config for c in cases)
    every = matrix_for(_Keys(*XLA_KEYS), dtype="bf16")
    assert len(every) == len(matrix_for(_Keys(*XLA_KEYS), dtype="fp32"))
    assert all(c.dtype == "bf16" and c.name.endswith("-bf16") for c in every)


# ------------------------------------------------------------------------------ the comparison


def _result(loss=1.0, w=0.5, frozen_w=2.0):
    return {
        "losses": [loss, loss * 0.9],
        "grad_norms": [3.0, 2.0],
        "lrs": [1e-2, 1e-2],
        "params": {"w": torch.tensor([w]), "f": torch.tensor([frozen_w])},
        "frozen": ["f"],
        "probe": torch.tensor([[1.0, 2.0]]),
    }


def _sharded(**kw):
    r = _result(**{k: kw.pop(k) for k in list(kw) if k in ("loss", "w", "frozen_w")})
    del r["probe"]
    r["checkpoint"] = {
        "method": "test",
        "fresh_param_diff": 0.0,
        "reload_param_diff": 0.0,
        "probe": torch.tensor([[1.0, 2.0]]),
        **kw,
    }
    return r


def test_compare_passes_equal_runs_and_names_each_failure():
    assert compare("c", _result(), _sharded()).ok
    tol = TOLERANCES["fp32"]
    cases = {
        "frozen parameter f": _sharded(frozen_w=2.0 + 1e-6),  # within param_atol, but frozen must be exact
        "checkpoint round trip (test): a fresh single-device model": _sharded(fresh_param_diff=1e-3),
        "loaded from its own checkpoint": _sharded(reload_param_diff=1e-3),
        "outputs of the model loaded from the checkpoint": _sharded(
            probe=torch.tensor([[1.0, 2.0 + 10 * tol.output_atol]])
        ),
        "final parameter w differs": _sharded(w=0.5 + 10 * tol.param_atol),
        "loss differs at step 0": _sharded(loss=1.0 + 1e-3),
    }
    for expected, got in cases.items():
        v = compare("c", _result(), got)
        assert not v.ok and any(expected in r for r in v.reasons), (expected, v.reasons)
    nan = _sharded(w=math.nan)
    assert not compare("c", _result(), nan).ok
    lr = _sharded()
    lr["lrs"] = [1e-2, 5e-3]
    assert any("learning rate differs at step 1" in r for r in compare("c", _result(), lr).reasons)


# ------------------------------------------------------------------------------ the CLI, in process


def test_cli_list_and_usage_errors(capsys):
    assert cli_main(["--backend", "fsdp2", "--list", "--dtype", "fp32", "--cases", "frozen-*"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["frozen-mlp", "frozen-llama", "frozen-gpt2"]
    assert cli_main(["--backend", "fsdp2", "--list", "--json", "--cases", "uneven-mlp"]) == 0
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["model"] == "mlp_uneven" and row["global_batch"] == 8
    assert cli_main(["--backend", "no-such-backend", "--list"]) == 2
    assert "no backend named 'no-such-backend'" in capsys.readouterr().err
    assert cli_main(["--backend", "fsdp2", "--cases", "nothing-like-this", "--list"]) == 2
    assert "no case matches" in capsys.readouterr().err
    assert cli_main(["--backend", "backends_for_tests:UnavailableBackend", "--report", "unused"]) == 2
    assert "not available here: its runtime library is not installed" in capsys.readouterr().err


def test_malformed_xfails_file_is_a_usage_error(tmp_path, capsys):
    xf = tmp_path / "xfails.txt"
    xf.write_text("grad_accum-mlp\n")
    assert (
        cli_main(["--backend", "fsdp2", "--cases", "grad_accum-mlp", "--xfails", str(xf), "--report", str(tmp_path)])
        == 2
    )
    assert "line 1: 'grad_accum-mlp' has no reason" in capsys.readouterr().err
    assert cli_main(["--backend", "fsdp2", "--cases", "grad_accum-mlp", "--xfails", str(tmp_path / "none.txt")]) == 2
    assert "cannot read it" in capsys.readouterr().err
