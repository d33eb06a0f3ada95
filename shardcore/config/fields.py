"""Per-key validation: each validator turns what a user may write for one key into the one form
``ShardConfig`` holds, or raises a :class:`ShardConfigError` naming that key.

``show_value`` and ``dtype_name`` are public because backends validate their own settings and must
word their errors, and spell dtypes, the way shardcore does.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any, Mapping

from ..errors import ShardConfigError, UnknownKeyError
from .schema import (
    AUTO_WRAP_POLICIES,
    COMPILE_MODES,
    FIELD_NAMES,
    STATE_DICT_TYPES,
    TP_STYLES,
    TP_STYLES_UNSUPPORTED,
    MixedPrecision,
)

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


def as_bool(key: str, value: Any) -> bool:
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
    return as_bool(key, value)


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

            # only the floating dtypes a name can also give: a config must read back from its dict form
            if isinstance(value, torch.dtype) and str(value).removeprefix("torch.") in _DTYPE_NAMES.values():
                return str(value).removeprefix("torch.")
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
    raise ShardConfigError(
        key,
        f"{show_value(value)} is not a dtype shardcore takes. Use one of bf16, fp16, fp32 (or bfloat16, float16, float32).",
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


def _mesh_size(key: str, value: Any) -> int | None:
    """A data-parallel mesh dimension: a positive integer (YAML and env-style strings accepted)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**20:
        raise ShardConfigError(key, f"must be a positive integer (a number of ranks), got {show_value(value)}.")
    return value


def _tp_size(key: str, value: Any) -> int:
    size = _mesh_size(key, value)
    return 1 if size is None else size


def _tp_plan(key: str, value: Any) -> str | dict[str, str] | None:
    """``"auto"`` (the model's own plan) or module-name pattern -> style, transformers' style names;
    ``*`` in a pattern stands for one dotted part of the name (a layer number)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().startswith("{"):  # a JSON object, as a CLI or env var gives it
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ShardConfigError(key, f"is not valid JSON ({e}). Write a JSON object of pattern -> style.") from None
    if not isinstance(value, Mapping) or not value:
        raise ShardConfigError(
            key,
            f'must be "auto" (the model\'s own tensor-parallel plan) or a non-empty mapping of module-name pattern -> '
            f'style, such as {{"layers.*.mlp.up_proj": "colwise"}}; got {show_value(value)}.',
        )
    out: dict[str, str] = {}
    for pattern, style in value.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise ShardConfigError(key, f"has the pattern {show_value(pattern)}; patterns are module names (strings).")
        check_tp_style(key, style, f"pattern {pattern!r}")
        out[pattern.strip()] = style
    return out


def check_tp_style(key: str, style: Any, where: str) -> None:
    """A style shardcore applies, or a :class:`ShardConfigError` on ``key`` naming ``where`` (the
    pattern that has the style) and the styles it does apply."""
    if isinstance(style, str) and style in TP_STYLES:
        return
    if isinstance(style, str) and style in TP_STYLES_UNSUPPORTED:
        raise ShardConfigError(
            key,
            f"gives {where} the style {style!r}, a transformers tensor-parallel style shardcore does not apply. "
            f"Supported: {', '.join(TP_STYLES)}. Give a tp_plan without it (that module then stays whole on every "
            "tp rank).",
        )
    # str() of a 5000-digit int raises; only a string can be a misspelt style
    close = difflib.get_close_matches(style, TP_STYLES, n=1) if isinstance(style, str) else []
    raise ShardConfigError(
        key,
        f"gives {where} the style {show_value(style)}, not a tensor-parallel style"
        f"{f' (did you mean {close[0]!r}?)' if close else ''}. Use one of {', '.join(TP_STYLES)}.",
    )


def _compile_backend(key: str, value: Any) -> str | None:
    """A ``torch.compile`` backend by the name torch registers it under (``inductor``,
    ``aot_eager``, ``openxla``, or one a user registered); accelerate writes them upper-case."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ShardConfigError(
            key, f"must be a torch.compile backend name such as 'inductor', got {show_value(value)}."
        )
    name = value.strip().lower()
    import torch._dynamo  # only when the key is given: importing dynamo takes a moment

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ShardConfigError(
            key,
            f"{show_value(value)} is not a torch.compile backend here. Use one of "
            f"{', '.join(n for n in known if 'TESTING' not in n)} "
            "(or register yours with torch._dynamo.register_backend before building the config).",
        )
    return name


def _compile_mode(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in COMPILE_MODES:
        return value.strip().lower()
    raise ShardConfigError(key, f"must be one of {', '.join(COMPILE_MODES)}, got {show_value(value)}.")


def _optional_bool(key: str, value: Any) -> bool | None:
    return None if value is None else as_bool(key, value)


VALIDATORS = {
    "version": _version,
    "backend": _backend,
    "reshard_after_forward": _reshard,
    "auto_wrap_policy": _choice(AUTO_WRAP_POLICIES),
    "transformer_layer_cls_to_wrap": _class_list,
    "min_num_params": _min_num_params,
    "cpu_offload": as_bool,
    "state_dict_type": _choice(STATE_DICT_TYPES),
    "async_save": as_bool,
    "cpu_ram_efficient_loading": as_bool,
    "activation_checkpointing": as_bool,
    "mixed_precision": _mixed_precision,
    "xla": as_bool,
    "xla_fsdp_v2": as_bool,
    "xla_fsdp_settings": _xla_settings,
    "xla_fsdp_grad_ckpt": as_bool,
    "timeout": _timeout,
    "dp_replicate_size": _mesh_size,
    "dp_shard_size": _mesh_size,
    "tp_size": _tp_size,
    "tp_plan": _tp_plan,
    "torch_compile": as_bool,
    "torch_compile_backend": _compile_backend,
    "torch_compile_mode": _compile_mode,
    "torch_compile_fullgraph": as_bool,
    "torch_compile_dynamic": _optional_bool,
    "torch_compile_regional": as_bool,
    "use_cpu": as_bool,
}
# A field without a validator would surface as a KeyError in the parser instead of a ShardConfigError.
assert set(VALIDATORS) == FIELD_NAMES
