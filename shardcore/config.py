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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ShardConfigError, UnknownKeyError

AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")

# Names users write for dtypes (accelerate's "bf16", torch's "bfloat16", "torch.bfloat16").
_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp64": "float64",
    "float64": "float64",
}

# FSDP1 keys of TrainingArguments/accelerate. They are known, so they get a precise message instead
# of a did-you-mean, but FSDP2 has no such setting, so accepting them would silently ignore them.
_FSDP1_ONLY_KEYS = {
    "backward_prefetch": "FSDP2 always prefetches the next all-gather in backward",
    "forward_prefetch": "FSDP2 has no forward prefetch setting",
    "limit_all_gathers": "FSDP2 limits in-flight all-gathers itself",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "sync_module_states": "use cpu_ram_efficient_loading to broadcast rank 0's weights",
    "sharding_strategy": "use reshard_after_forward (true = FULL_SHARD, false = SHARD_GRAD_OP)",
    "forward_prefetch_limit": "FSDP2 has no forward prefetch setting",
}

# Top-level keys of an accelerate config YAML that configure the launcher, not sharding. They are
# accepted (the same file drives `accelerate launch`) but do not change how a model is sharded.
_ACCELERATE_LAUNCHER_KEYS = {
    "compute_environment",
    "debug",
    "distributed_type",
    "downcast_bf16",
    "dynamo_config",
    "enable_cpu_affinity",
    "gpu_ids",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "main_training_function",
    "megatron_lm_config",
    "mixed_precision",
    "num_machines",
    "num_processes",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "use_cpu",
    "fsdp_config",
    "parallelism_config",
}


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2 ``MixedPrecisionPolicy`` in backend-neutral form (dtype names, not torch objects)."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None

    def torch_dtypes(self) -> dict[str, Any]:
        import torch

        return {k: (getattr(torch, v) if v is not None else None) for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class ShardConfig:
    """Validated sharding settings. Build it with :func:`parse_config`, not by hand.

    ``explicit`` is the set of keys the user wrote; backends are checked against keys whose value
    differs from the default, so a ``TrainingArguments`` that fills in ``xla: False`` everywhere still
    works with FSDP2.
    """

    version: int = 2
    backend: str | None = None
    reshard_after_forward: bool = True
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    min_num_params: int = 0
    cpu_offload: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    mixed_precision: MixedPrecision | None = None
    xla: bool = False
    xla_fsdp_v2: bool = False
    xla_fsdp_settings: Mapping[str, Any] = field(default_factory=dict)
    xla_fsdp_grad_ckpt: bool = False
    timeout: float = 1800.0
    explicit: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)

    @property
    def backend_name(self) -> str:
        """The backend this config selects: ``backend`` if given, ``xla`` if ``xla: true``, else FSDP2."""
        if self.backend is not None:
            return self.backend
        return "xla" if self.xla else "fsdp2"

    def non_default_keys(self) -> list[str]:
        """Keys whose value differs from the default: what a backend must be able to honour."""
        defaults = ShardConfig()
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("explicit", "version", "backend") and getattr(self, f.name) != getattr(defaults, f.name)
        ]

    def replace(self, **changes: Any) -> "ShardConfig":
        """A new validated config with ``changes`` applied (same rules as :func:`parse_config`)."""
        raw = self.to_dict()
        raw.update(changes)
        return parse_config(raw)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable) that :func:`parse_config` reads back unchanged."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "explicit":
                continue
            v = getattr(self, f.name)
            if isinstance(v, MixedPrecision):
                v = {k: x for k, x in dataclasses.asdict(v).items() if x is not None}
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        if out["backend"] is None:
            del out["backend"]
        if out["mixed_precision"] is None:
            del out["mixed_precision"]
        return out


# Aliases: other spellings of a key, mapped to the canonical name.
_ALIASES = {
    "offload_params": "cpu_offload",  # accelerate's fsdp_offload_params
    "mixed_precision_policy": "mixed_precision",  # accelerate's FullyShardedDataParallelPlugin field
    "activation_checkpointing": "activation_checkpointing",
    "xla_fsdp_config": "xla_fsdp_settings",
}

_FIELD_NAMES = {f.name for f in dataclasses.fields(ShardConfig)} - {"explicit"}


def known_keys() -> set[str]:
    """Every key a config dict may hold (canonical names and aliases, without ``fsdp_`` prefixes)."""
    return _FIELD_NAMES | set(_ALIASES)


def parse_config(source: Any = None, **overrides: Any) -> ShardConfig:
    """Turn any supported config source into a validated :class:`ShardConfig`.

    ``overrides`` are keys applied on top of the source (same names and rules).
    """
    if isinstance(source, ShardConfig) and not overrides:
        return source
    raw = _load_source(source)
    raw.update(overrides)
    return _from_dict(raw)


def _load_source(source: Any) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, ShardConfig):
        return source.to_dict()
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        return _load_file(Path(source))
    if _is_training_arguments(source):
        return _from_training_arguments(source)
    raise ShardConfigError(
        "config",
        f"cannot read a config from a {type(source).__name__}. Pass a dict, a path to a JSON or "
        "accelerate YAML file, a transformers.TrainingArguments or a ShardConfig.",
    )


def _load_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ShardConfigError("config", f"{str(path)!r} is not a file. Pass an existing JSON or YAML config path.")
    text = path.read_text()
    if path.suffix.lower() in (".yaml", ".yml"):
        return _from_accelerate_yaml(text, path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ShardConfigError(
            "config", f"{str(path)!r} is not valid JSON ({e}). Fix the file or use a .yaml file."
        ) from None
    if not isinstance(data, dict):
        raise ShardConfigError("config", f"{str(path)!r} holds a {type(data).__name__}, not a JSON object of keys.")
    return data


def _from_accelerate_yaml(text: str, path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ShardConfigError("config", f"{str(path)!r} is not valid YAML ({e}).") from None
    if not isinstance(data, dict):
        raise ShardConfigError("config", f"{str(path)!r} holds no YAML mapping of keys.")
    for key in data:
        if key not in _ACCELERATE_LAUNCHER_KEYS:
            raise UnknownKeyError(str(key), _ACCELERATE_LAUNCHER_KEYS, where=f"accelerate config {path}")
    dist_type = data.get("distributed_type")
    if dist_type is not None and str(dist_type).upper() not in ("FSDP", "XLA"):
        raise ShardConfigError(
            "distributed_type",
            f"{show_value(dist_type)} in {path} does not shard parameters. Set distributed_type: FSDP "
            "(or XLA for torch_xla) to use this file with shardcore.",
        )
    fsdp = data.get("fsdp_config")
    if fsdp is None:
        fsdp = {}
    if not isinstance(fsdp, dict):
        raise ShardConfigError("fsdp_config", f"must be a mapping of fsdp_ keys, got {show_value(fsdp)}.")
    raw = dict(fsdp)
    if "fsdp_version" not in raw and "version" not in raw:
        # accelerate's own default is FSDP1; we refuse it explicitly rather than guess.
        raw["version"] = 1
    mp = data.get("mixed_precision")
    if mp is not None and "mixed_precision" not in raw and "fsdp_mixed_precision" not in raw:
        raw["mixed_precision"] = mp
    if dist_type is not None and str(dist_type).upper() == "XLA":
        raw.setdefault("xla", True)
    return raw


def _is_training_arguments(obj: Any) -> bool:
    return any(c.__name__ == "TrainingArguments" for c in type(obj).__mro__)


def _from_training_arguments(args: Any) -> dict[str, Any]:
    """What the Trainer does with ``fsdp``, ``fsdp_config``, precision and timeout flags."""
    fsdp_config = getattr(args, "fsdp_config", None)
    if isinstance(fsdp_config, (str, os.PathLike)):
        raw = _load_file(Path(fsdp_config))
    else:
        raw = dict(fsdp_config or {})
    # Older Transformers took `fsdp="full_shard offload"`; newer ones fold those options into
    # fsdp_config in __post_init__ and leave `fsdp=True`.
    options = getattr(args, "fsdp", None)
    if isinstance(options, str):
        options = options.split()
    names = {getattr(o, "value", o) for o in options} if isinstance(options, (list, tuple)) else set()
    if "offload" in names:
        raw.setdefault("cpu_offload", True)
    if "shard_grad_op" in names:
        raw.setdefault("reshard_after_forward", False)
    if getattr(args, "bf16", False):
        raw.setdefault("mixed_precision", "bf16")
    elif getattr(args, "fp16", False):
        raw.setdefault("mixed_precision", "fp16")
    timeout = getattr(args, "ddp_timeout", None)
    if timeout is not None:
        raw.setdefault("timeout", timeout)
    trainer_ckpt = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)
    fsdp_ckpt = raw.get("activation_checkpointing", raw.get("fsdp_activation_checkpointing"))
    if trainer_ckpt and fsdp_ckpt is not None and _bool("activation_checkpointing", fsdp_ckpt):
        raise ShardConfigError(
            "activation_checkpointing",
            "is true in fsdp_config and the TrainingArguments activation_checkpointing (or "
            "gradient_checkpointing) flag is also true; setting both raises an error (Transformers "
            "FSDP guide). Keep fsdp_config's activation_checkpointing only.",
        )
    # Trainer fills its own defaults into fsdp_config (e.g. min_num_params 0, xla False); those that
    # equal ours are harmless, the rest are validated like any user key.
    return raw


def _from_dict(raw: Mapping[str, Any]) -> ShardConfig:
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ShardConfigError(show_value(key), "config keys must be strings.")
        name = key[5:] if key.startswith("fsdp_") else key
        if name in _FSDP1_ONLY_KEYS:
            raise ShardConfigError(
                key,
                f"{show_value(value)} is an FSDP1 setting with no FSDP2 meaning ({_FSDP1_ONLY_KEYS[name]}). Remove it.",
            )
        name = _ALIASES.get(name, name)
        if name not in _FIELD_NAMES:
            raise UnknownKeyError(key, known_keys())
        if name in values and values[name] != value:
            raise ShardConfigError(
                key,
                f"is given twice with different values ({show_value(values[name])} and {show_value(value)}). Keep one.",
            )
        values[name] = value
        explicit.add(name)

    out: dict[str, Any] = {}
    for name, value in values.items():
        out[name] = _VALIDATORS[name](name, value)

    cfg = ShardConfig(**out, explicit=frozenset(explicit))
    _check_combinations(cfg)
    return cfg


# ---------------------------------------------------------------- per-key validation


def show_value(value: Any, limit: int = 120) -> str:
    """``repr`` for error messages (shardcore's and backends'), bounded: a 5000-digit int or a large nested value must not make
    the message itself fail (Python refuses to print ints over 4300 digits) or run to megabytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"{'-' if value < 0 else ''}<integer of about {int(value.bit_length() * 0.30103)} digits>"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a nested huge int, or an object with a broken __repr__
        text = f"<unprintable {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 5] + " ...>"


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ShardConfigError(key, f"must be true or false, got {show_value(value)} ({type(value).__name__}).")


def _version(key: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdecimal():  # not isdigit: int("²") fails
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShardConfigError(key, f"must be the integer 2, got {show_value(value)}.")
    if value == 1:
        raise ShardConfigError(
            key,
            "1 selects FSDP1, which shardcore does not support. Set version: 2 (accelerate: "
            "fsdp_version: 2); FSDP1 keys such as sharding_strategy map to reshard_after_forward.",
        )
    if value != 2:
        raise ShardConfigError(key, f"must be 2, got {show_value(value)}.")
    return value


def _backend(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ShardConfigError(key, f"must be a backend name such as 'fsdp2' or 'xla', got {show_value(value)}.")
    value = value.strip()
    # a registered name, or "package.module:Class" (both halves dotted identifiers)
    module, sep, attr = value.partition(":")
    if sep:
        ok = all(p.isidentifier() for p in module.split(".") + attr.split("."))
    else:  # entry-point names may hold hyphens and dots
        ok = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", value) is not None
    if not ok:
        raise ShardConfigError(
            key,
            f"{show_value(value)} is neither a backend name (such as 'fsdp2' or 'xla') nor a "
            "'package.module:BackendClass' path.",
        )
    return value


def _choice(choices: tuple[str, ...]):
    def check(key: str, value: Any) -> str:
        if isinstance(value, str) and value.strip().upper() in choices:
            return value.strip().upper()
        raise ShardConfigError(key, f"must be one of {', '.join(choices)}, got {show_value(value)}.")

    return check


def _reshard(key: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().upper() in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
        raise ShardConfigError(
            key,
            f"{show_value(value)} is an FSDP1 sharding strategy. With FSDP2 set true (like FULL_SHARD) or "
            "false (like SHARD_GRAD_OP).",
        )
    return _bool(key, value)


def _class_list(key: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = []
        for v in value:
            if not isinstance(v, str):
                raise ShardConfigError(
                    key, f"must list class names as strings, got {show_value(v)} in {show_value(value)}."
                )
            items.append(v.strip())
    else:
        raise ShardConfigError(
            key, f"must be a list of class names or a comma-separated string, got {show_value(value)}."
        )
    items = [v for v in items if v]
    for v in items:
        if not v.isidentifier():
            raise ShardConfigError(key, f"{show_value(v)} is not a class name (in {show_value(value)}).")
    return tuple(dict.fromkeys(items))


def _min_num_params(key: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            raise ShardConfigError(key, f"must be a non-negative integer, got {show_value(value)}.") from None
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)  # accelerate YAML often says 1e8
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShardConfigError(key, f"must be a non-negative integer, got {show_value(value)}.")
    return value


def dtype_name(key: str, value: Any) -> str | None:
    """The canonical name (``"bfloat16"``) of a dtype given as a ``torch.dtype`` or a string in any
    spelling the ecosystem uses (``"bf16"``, ``"torch.bfloat16"``); None stays None. Anything else
    is a :class:`ShardConfigError` naming ``key``. Backends use it for their own dtype settings."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
    else:
        try:
            import torch

            if isinstance(value, torch.dtype):
                return str(value).removeprefix("torch.")
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
    raise ShardConfigError(
        key, f"{show_value(value)} is not a dtype. Use one of bf16, fp16, fp32 (or bfloat16, float16, float32)."
    )


def _mixed_precision(key: str, value: Any) -> MixedPrecision | None:
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.strip().lower() in ("no", "none", "false", ""):
        return None
    if isinstance(value, (str,)) or _is_torch_dtype(value):
        # accelerate's mixed_precision: bf16 -> parameters and gradient reduction in bf16.
        dt = dtype_name(key, value)
        if dt == "float32":
            return None
        return MixedPrecision(param_dtype=dt, reduce_dtype=dt)
    if isinstance(value, Mapping):
        allowed = ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype")
        kwargs = {}
        for k, v in value.items():
            if k not in allowed:
                raise UnknownKeyError(f"{key}.{k}", [f"{key}.{a}" for a in allowed[:3]])
            if k == "buffer_dtype":
                raise ShardConfigError(
                    f"{key}.buffer_dtype",
                    "FSDP2 does not cast buffers; remove it (cast buffers on the model yourself).",
                )
            kwargs[k] = dtype_name(f"{key}.{k}", v)
        return MixedPrecision(**kwargs)
    raise ShardConfigError(
        key, f"must be 'no', 'bf16', 'fp16' or a mapping of param_dtype/reduce_dtype, got {show_value(value)}."
    )


def _is_torch_dtype(value: Any) -> bool:
    return type(value).__name__ == "dtype" and type(value).__module__ == "torch"


def _xla_settings(key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ShardConfigError(
                key, f"must be a mapping of XlaFullyShardedDataParallel arguments, got {show_value(value)}."
            ) from None
    if not isinstance(value, Mapping):
        raise ShardConfigError(
            key, f"must be a mapping of XlaFullyShardedDataParallel arguments, got {show_value(value)}."
        )
    for k in value:
        if not isinstance(k, str):
            raise ShardConfigError(f"{key}.{show_value(k)}", "setting names must be strings.")
    # Which names and values are valid is the XLA backend's business (it knows the class).
    return dict(value)


def _timeout(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ShardConfigError(key, f"must be a number of seconds, got {show_value(value)}.")
    if value <= 0 or value > 7 * 24 * 3600 or not math.isfinite(value):  # huge ints: no float()
        raise ShardConfigError(key, f"must be a positive number of seconds up to a week, got {show_value(value)}.")
    return float(value)


_VALIDATORS = {
    "version": _version,
    "backend": _backend,
    "reshard_after_forward": _reshard,
    "auto_wrap_policy": _choice(AUTO_WRAP_POLICIES),
    "transformer_layer_cls_to_wrap": _class_list,
    "min_num_params": _min_num_params,
    "cpu_offload": _bool,
    "state_dict_type": _choice(STATE_DICT_TYPES),
    "cpu_ram_efficient_loading": _bool,
    "activation_checkpointing": _bool,
    "mixed_precision": _mixed_precision,
    "xla": _bool,
    "xla_fsdp_v2": _bool,
    "xla_fsdp_settings": _xla_settings,
    "xla_fsdp_grad_ckpt": _bool,
    "timeout": _timeout,
}
assert set(_VALIDATORS) == _FIELD_NAMES


def _check_combinations(cfg: ShardConfig) -> None:
    if cfg.auto_wrap_policy == "SIZE_BASED_WRAP" and cfg.min_num_params <= 0:
        raise ShardConfigError(
            "min_num_params",
            f"is {show_value(cfg.min_num_params)} with auto_wrap_policy SIZE_BASED_WRAP; every module would be "
            "its own unit. Set min_num_params to a positive parameter count (e.g. 1e6).",
        )
    if "min_num_params" in cfg.explicit and cfg.min_num_params > 0 and cfg.auto_wrap_policy != "SIZE_BASED_WRAP":
        raise ShardConfigError(
            "min_num_params",
            f"is {show_value(cfg.min_num_params)} but auto_wrap_policy is {cfg.auto_wrap_policy}, which does not use "
            "it. Set auto_wrap_policy: SIZE_BASED_WRAP or remove min_num_params.",
        )
    if cfg.transformer_layer_cls_to_wrap and cfg.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
        raise ShardConfigError(
            "transformer_layer_cls_to_wrap",
            f"is set but auto_wrap_policy is {cfg.auto_wrap_policy}, which does not use it. Set "
            "auto_wrap_policy: TRANSFORMER_BASED_WRAP or remove the class list.",
        )
    if cfg.backend is not None and cfg.xla and cfg.backend != "xla":
        raise ShardConfigError("backend", f"is {cfg.backend!r} but xla is true, which selects 'xla'. Keep one of them.")
    xla_only = [k for k in ("xla_fsdp_v2", "xla_fsdp_grad_ckpt") if getattr(cfg, k)]
    if cfg.xla_fsdp_settings:
        xla_only.append("xla_fsdp_settings")
    if xla_only and cfg.backend_name != "xla":
        raise ShardConfigError(
            xla_only[0],
            f"is set but the backend is {cfg.backend_name!r}; XLA keys need xla: true (as in "
            "TrainingArguments). Set xla: true or remove the XLA keys.",
        )
