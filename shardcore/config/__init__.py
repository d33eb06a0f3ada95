"""``ShardConfig``: the one validated, frozen form of every config source.

Sources (all end in :func:`parse_config`):

* a ``dict`` with the keys of ``TrainingArguments(fsdp_config=...)`` (``fsdp_`` prefixes allowed, as
  the Trainer allows them);
* a path to a JSON FSDP config file (``{"version": 2, ...}``), the file ``--fsdp_config`` takes;
* a path to an accelerate config YAML (``distributed_type: FSDP`` with an ``fsdp_config:`` section of
  ``fsdp_``-prefixed keys, and the top-level ``mixed_precision``);
* a ``transformers.TrainingArguments`` (its ``fsdp_config``, ``fsdp`` options, ``bf16``/``fp16``,
  ``gradient_checkpointing`` and ``ddp_timeout``);
* a ``ShardConfig`` (returned as is).

Keys mean what they mean in the Transformers FSDP2 guide. Nothing is ignored: an unknown key is an
error with a did-you-mean, and a known key that the chosen backend cannot honour is an error when the
backend is picked (see :mod:`shardcore.backend`).

Layout: :mod:`.sources` reads a source into a raw dict, :mod:`.schema` says which keys exist,
:mod:`.fields` validates each key, :mod:`.checks` validates keys against each other.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import ShardConfigError, UnknownKeyError
from .checks import check_combinations
from .fields import VALIDATORS, dtype_name, show_value
from .schema import (
    AUTO_WRAP_POLICIES,
    FIELD_NAMES,
    FSDP1_ONLY_KEYS,
    KEY_ALIASES,
    STATE_DICT_TYPES,
    MixedPrecision,
    ShardConfig,
    known_keys,
)
from .sources import load_source

__all__ = [
    "AUTO_WRAP_POLICIES",
    "FIELD_NAMES",
    "KEY_ALIASES",
    "STATE_DICT_TYPES",
    "MixedPrecision",
    "ShardConfig",
    "dtype_name",
    "known_keys",
    "parse_config",
    "show_value",
]


def parse_config(source: Any = None, **overrides: Any) -> ShardConfig:
    """Turn any supported config source into a validated :class:`ShardConfig`.

    ``overrides`` are keys applied on top of the source (same names and rules).
    """
    if isinstance(source, ShardConfig) and not overrides:
        return source
    raw = load_source(source)
    raw.update(overrides)
    return _from_dict(raw)


def _from_dict(raw: Mapping[str, Any]) -> ShardConfig:
    values = _canonical_keys(raw)
    out = {name: VALIDATORS[name](name, value) for name, value in values.items()}
    if "torch_compile" not in out and (out.get("torch_compile_backend") or out.get("torch_compile_mode")):
        # TrainingArguments: "setting torch_compile_backend (or _mode) will enable torch_compile"
        out["torch_compile"] = True
    cfg = ShardConfig(**out, explicit=frozenset(values))
    check_combinations(cfg)
    return cfg


def _canonical_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` under canonical key names (``fsdp_`` prefix and aliases removed), values untouched.

    Two spellings of one key (``fsdp_cpu_offload`` in a file, ``cpu_offload=`` as an override) are
    fine when they agree; when they differ, neither may win silently.
    """
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ShardConfigError(show_value(key), "config keys must be strings.")
        name = key[5:] if key.startswith("fsdp_") else key
        if name in FSDP1_ONLY_KEYS:
            raise ShardConfigError(
                key,
                f"{show_value(value)} is an FSDP1 setting with no FSDP2 meaning ({FSDP1_ONLY_KEYS[name]}). Remove it.",
            )
        name = KEY_ALIASES.get(name, name)
        if name not in FIELD_NAMES:
            raise UnknownKeyError(key, known_keys())
        if name in values and values[name] != value:
            raise ShardConfigError(
                key,
                f"is given twice with different values ({show_value(values[name])} and {show_value(value)}). Keep one.",
            )
        values[name] = value
    return values
