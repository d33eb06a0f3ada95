"""Fuzzed configs: every input either parses / shards, or raises a ShardcoreError naming the key.

Generated configs mix real keys (with and without ``fsdp_`` prefixes and aliases) and unknown ones,
with values of the wrong type, odd strings, huge numbers and nested junk. The oracle is the same
for every example: no exception other than a ``ShardcoreError``; a ``ShardConfigError`` or
``WrapPlanError`` carries a ``.key`` that is (or whose message names) a key of the input.
"""

from __future__ import annotations

import math
import reprlib

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardcore
from shardcore import ShardConfigError, ShardcoreError, WrapPlanError
from shardcore.config import FIELD_NAMES, KEY_ALIASES, known_keys
from shardcore_conformance.models import MLP

FIELDS = sorted(FIELD_NAMES)
ALIASES = sorted(KEY_ALIASES)
FSDP1 = ["sharding_strategy", "backward_prefetch", "use_orig_params", "limit_all_gathers"]

real_key = st.sampled_from(FIELDS + ALIASES + FSDP1)
key = st.one_of(
    real_key,
    real_key.map(lambda k: "fsdp_" + k),
    real_key.map(lambda k: k.upper()),
    st.text(max_size=12),
)

# ints past 4300 digits cannot even be printed by repr(); built by map so the strategy's repr stays short
huge = st.one_of(
    st.sampled_from([400, 5000]).flatmap(lambda n: st.sampled_from([10**n, -(10**n)])),
    st.sampled_from([2**63, -1, 0, 1, 2, 1e308, -1e308, 1e-320]),
)
odd_strings = st.sampled_from(
    [
        "",
        " ",
        "²",
        "١٢",
        "1e999",
        "nan",
        "inf",
        "-0",
        "0x10",
        "1_000",
        "TRUE",
        " true ",
        "no",
        "bf16",
        "torch.float16",
        "FULL_SHARD",
        "NO_WRAP",
        "size_based_wrap",
        ":",
        "a:",
        ":b",
        ".",
        "..x:Y",
        "os:path",
        "sys:",
        "fsdp2",
        "xla",
        "{}",
        "[1]",
        '{"a": [1, {"b": null}]}',
        "LlamaDecoderLayer, MLPBlock",
        "1e8",
        "\x00",
        "\ud800",
        "a" * 300,
    ]
)
scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    huge,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    odd_strings,
    st.sampled_from([torch.float16, torch.bfloat16, torch.int8]),
)
junk = st.recursive(
    scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(
            st.one_of(
                st.text(max_size=8),
                st.integers(),
                st.sampled_from(["param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype", "compute_dtype"]),
            ),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=12,
)
configs = st.dictionaries(key, junk, max_size=6)


def _norm(k: object) -> str:
    """A key as the parser reads it: no fsdp_ prefix, aliases resolved, dotted sub-keys cut off."""
    s = str(k)
    s = s.split(".")[0]
    s = s[5:] if s.startswith("fsdp_") else s
    return KEY_ALIASES.get(s, s)


def _r(x: object) -> str:
    try:
        return reprlib.repr(x)
    except Exception:  # noqa: BLE001 - a huge int inside
        return f"<{type(x).__name__}>"


def check_error(raw: dict, e: BaseException) -> None:
    assert isinstance(e, ShardcoreError), f"{type(e).__name__} escaped for {_r(raw)}: {_r(e.args)}"
    given_keys = {_norm(k) for k in raw} | {repr(k) for k in raw if not isinstance(k, str)} | {str(k) for k in raw}
    msg = str(e)
    assert len(msg) < 20_000, "error message is unbounded"
    if isinstance(e, (ShardConfigError, WrapPlanError)):
        assert isinstance(e.key, str), e
        named = _norm(e.key)
        assert named in known_keys() | {"config"} or e.key in given_keys, (e.key, _r(raw))
        # the key at fault is one the user wrote, or the message names the one it conflicts with
        assert named in given_keys or e.key in given_keys or any(f"{k}" in msg for k in given_keys if k), (
            e.key,
            _r(raw),
            msg,
        )
    else:
        assert any(k and k in msg for k in given_keys), (type(e).__name__, msg, _r(raw))


def _parse(raw: dict):
    try:
        return shardcore.parse_config(raw), None
    except BaseException as e:  # noqa: BLE001 - the oracle decides what is allowed
        check_error(raw, e)
        return None, e


@settings(max_examples=600, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
@example({"version": "²"})
@example({"timeout": 10**400})
@example({"version": 10**5000})
@example({"backend": ":"})
@example({"backend": "..x:Y"})
@example({"backend": "os:path"})
@example({"min_num_params": "9" * 5000, "auto_wrap_policy": "SIZE_BASED_WRAP"})
@example({"mixed_precision": {"param_dtype": "\ud800"}})
@example({"xla_fsdp_settings": {1: [None]}})
@example({"cpu_offload": float("nan"), "offload_params": float("nan")})
@example({"mixed_precision_policy": torch.int8})
@example({"tp_size": 2, "tp_plan": {"lm_head": 10**5000}})  # str() of it raised in the did-you-mean
def test_parse_config_accepts_or_names_the_key(raw):
    cfg, err = _parse(raw)
    if cfg is not None:
        # a config that parses is a fixed point of its own dict form
        assert shardcore.parse_config(cfg.to_dict()) == cfg
        assert isinstance(cfg.timeout, float) and math.isfinite(cfg.timeout) and cfg.timeout > 0


# shard() on a world of one (an in-process 1-rank gloo group): each example builds a small model,
# so fewer examples, drawn from keys that are real (wrong values still included).
shard_configs = st.dictionaries(
    st.one_of(real_key, real_key.map(lambda k: "fsdp_" + k)),
    st.one_of(junk, st.sampled_from(["MLPBlock", ["MLPBlock", "Linear"], "SIZE_BASED_WRAP", "NO_WRAP", 100, "bf16"])),
    max_size=4,
)


@settings(max_examples=200, deadline=10_000, suppress_health_check=[HealthCheck.too_slow])
@given(shard_configs)
@example({"backend": "os:path"})
@example({"backend": "sys:"})
@example({"transformer_layer_cls_to_wrap": "NoSuchBlock"})
@example({"auto_wrap_policy": "NO_WRAP", "activation_checkpointing": True})
@example({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10**400})
@example({"timeout": 10**400})
@example({"torch_compile": True})
def test_shard_accepts_or_names_the_key(raw):
    cfg, err = _parse(raw)
    if cfg is not None and cfg.backend_name not in ("fsdp2",):
        try:
            ok = shardcore.get_backend(cfg.backend_name).is_available()[0]
        except ShardcoreError:
            ok = False
        if ok:  # a real other backend (XLA) would start its runtime in this plain-torch process
            return
    model = MLP()
    try:
        out = shardcore.shard(model, raw)
    except BaseException as e:  # noqa: BLE001
        check_error(raw, e)
        return
    assert err is None, f"parse_config refused {_r(raw)} ({err}) but shard() accepted it"
    assert shardcore.handle(out).config == cfg
    compiled = any(getattr(m, "_shardcore_compiled", False) for m in out.modules())
    assert compiled == cfg.torch_compile, cfg
    # a compiled forward would run inductor here (g++ processes, tens of seconds), which belongs to
    # the multiprocess tier (tests/test_compile.py, the conformance compile family); this oracle is
    # about the config, so the forward runs the compiled units' code eagerly
    with torch.compiler.set_stance("force_eager"):
        loss = out(torch.randn(2, 13)).float().sum()
        loss.backward()
