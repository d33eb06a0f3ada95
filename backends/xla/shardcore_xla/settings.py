"""``xla_fsdp_settings`` and the config keys as torch_xla keyword arguments: the checks, then the conversion.

The checks (``check_*``) raise :class:`ShardConfigError` naming the key, the value and the fix; the
backend runs them from ``validate`` / ``validate_model``, before ``apply``. The conversions
(``*_kwargs``) take a config the checks accepted and raise nothing, so ``apply`` never meets a config
error halfway through wrapping.
"""

from __future__ import annotations

import inspect
from typing import Any

from shardcore.config import ShardConfig, dtype_name, show_value
from shardcore.errors import ShardConfigError, UnknownKeyError
from shardcore.validate import data_parallel_shape

# Set by shardcore from the plan, never by the user: accepting them would let a setting re-decide
# the wrapping behind the plan's back.
PLAN_OWNED = {"auto_wrap_policy", "auto_wrapper_callable"}
# Callables cannot come from a JSON/YAML config.
NOT_FROM_CONFIG = {"param_init_fn"}
DTYPE_SETTINGS = {"compute_dtype", "buffer_dtype"}
# What XLA FSDP on several CPU PJRT devices needs (see cpu.py): a pinned all_gather traces a different
# graph per device, and only the serialized step end may sync
CPU_NEEDS = {"pin_layout_in_collective_ops": False, "sync_on_finalization": False}


# ---------------------------------------------------------------- checks (validate, validate_model)


def fsdp_parameters() -> dict[str, inspect.Parameter]:
    """``XlaFullyShardedDataParallel``'s public keyword arguments, from its signature."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    params = inspect.signature(FSDP.__init__).parameters
    return {n: p for n, p in params.items() if n not in ("self", "module") and not n.startswith("_")}


#: the ``xla_fsdp_v2`` of the models this process has validated or sharded (None before): SPMD
#: (``xr.use_spmd()``) is global to a process, so a process serves one mode, whichever backend object asks
_process_mode: bool | None = None


def claim_mode(xla_fsdp_v2: bool) -> None:
    """Record that this process now runs the mode of ``xla_fsdp_v2`` (from validate_model / apply)."""
    global _process_mode
    _process_mode = xla_fsdp_v2


def check_mode(config: ShardConfig, serves: bool) -> None:
    """``config`` against the implementation serving ``xla_fsdp_v2: serves`` and this process's mode."""
    if config.xla_fsdp_v2 != serves:
        raise ShardConfigError(
            "xla_fsdp_v2",
            f"is {config.xla_fsdp_v2}, but this backend object is the XLA implementation for xla_fsdp_v2={serves}. "
            f"Pass backend='xla', which picks the implementation from the config, or set xla_fsdp_v2: {serves}.",
        )
    if _process_mode is not None and _process_mode != config.xla_fsdp_v2:
        raise ShardConfigError(
            "xla_fsdp_v2",
            f"is {config.xla_fsdp_v2} but this process already sharded a model with xla_fsdp_v2={_process_mode}; "
            "SPMD mode is global to a process. Use one mode per process.",
        )


def check_fsdp_settings(config: ShardConfig) -> None:
    """``xla_fsdp_settings`` checked against ``XlaFullyShardedDataParallel``'s arguments, each value
    against what the Trainer's conversion accepts; and no replicas (HSDP is SPMD only)."""
    if config.dp_replicate_size is not None and config.dp_replicate_size > 1:
        _refuse_fsdp_replicas("dp_replicate_size", config.dp_replicate_size, config.dp_replicate_size)
    valid = fsdp_parameters()
    settable = {n: p for n, p in valid.items() if n not in PLAN_OWNED | NOT_FROM_CONFIG}
    for name, value in config.xla_fsdp_settings.items():
        key = f"xla_fsdp_settings.{name}"
        if name in PLAN_OWNED:
            raise ShardConfigError(
                key,
                "is decided by shardcore's wrap plan. Use auto_wrap_policy / transformer_layer_cls_to_wrap / min_num_params.",
            )
        if name in NOT_FROM_CONFIG:
            raise ShardConfigError(key, "takes a Python callable, which a config cannot hold. Remove it.")
        if name not in settable:
            raise UnknownKeyError(
                key, [f"xla_fsdp_settings.{n}" for n in settable], where="XlaFullyShardedDataParallel arguments"
            )
        _check_value(key, value, settable[name].default)
    own = config.xla_fsdp_settings.get("reshard_after_forward")
    if (
        "reshard_after_forward" in config.xla_fsdp_settings
        and "reshard_after_forward" in config.explicit
        and own != config.reshard_after_forward
    ):
        raise ShardConfigError(
            "xla_fsdp_settings.reshard_after_forward",
            f"is {own} but reshard_after_forward is {config.reshard_after_forward}. Keep one.",
        )


def check_fsdp_replicas(config: ShardConfig, world_size: int) -> None:
    """XLA FSDP with ``world_size`` devices: the sizes must factor it, into one replica (a
    ``dp_shard_size`` below the device count means several). Every rank reaches the same verdict."""
    replicas, _ = data_parallel_shape(config, world_size)
    if replicas > 1:
        _refuse_fsdp_replicas("dp_shard_size", config.dp_shard_size, replicas)


def _refuse_fsdp_replicas(key: str, value: Any, replicas: int) -> None:
    raise ShardConfigError(
        key,
        f"is {show_value(value)}, which makes {replicas} replica groups (HSDP), but XLA FSDP (xla_fsdp_v2: false) "
        "cannot train replicas: torch_xla 2.9's XlaFullyShardedDataParallel sharding_groups only confine its "
        "all-gather and reduce-scatter to a group (for Megatron-style model parallelism) and never all-reduce "
        "gradients across the groups, so the replicas would train apart. Set xla_fsdp_v2: true for HSDP on XLA "
        "(SPMD, mesh (replicate, fsdp)), or remove the key to shard over every device.",
    )


def check_spmd_settings(config: ShardConfig) -> None:
    if config.xla_fsdp_settings:
        name = next(iter(config.xla_fsdp_settings))
        raise ShardConfigError(
            f"xla_fsdp_settings.{name}",
            "is an XlaFullyShardedDataParallel argument; SPMD FSDPv2 (xla_fsdp_v2: true) takes none of "
            "them (the Trainer does not pass them either). Remove xla_fsdp_settings or set xla_fsdp_v2: false.",
        )
    if not config.reshard_after_forward:
        raise ShardConfigError(
            "reshard_after_forward",
            "is false, but SPMD FSDPv2 has no such setting (the XLA compiler schedules the gathers). "
            "Remove it or set xla_fsdp_v2: false.",
        )


def check_cpu_fsdp_settings(config: ShardConfig) -> None:
    """XLA FSDP on several CPU devices: refuse the settings the CPU recipe cannot honour. It needs the
    device count, so ``validate_model`` runs it (every device reaches the same verdict from the config)."""
    for name, needed in CPU_NEEDS.items():
        if name in config.xla_fsdp_settings and config.xla_fsdp_settings[name] != needed:
            raise ShardConfigError(
                f"xla_fsdp_settings.{name}",
                f"is {config.xla_fsdp_settings[name]!r}, but XLA FSDP on several CPU PJRT devices needs {needed} "
                "(torch_xla 2.9's CPU collectives meet only when every device thread runs the same compiled module; "
                f"see the README's XLA section). Remove {name} or run on one CPU device or a TPU.",
            )


def _check_value(key: str, value: Any, default: Any) -> None:
    name = key.rsplit(".", 1)[1]
    if name in DTYPE_SETTINGS:
        dtype_name(key, value)  # raises for a name that is not a dtype
        return
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ShardConfigError(key, f"must be true or false, got {show_value(value)}.")
        return
    if name in ("sharding_rank", "sharding_world_size", "reduce_scatter_bucket_size_mb") or isinstance(default, int):
        if value is None and default is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise ShardConfigError(key, f"must be a non-negative integer below 2**31, got {show_value(value)}.")
        return
    if name == "sharding_groups":
        if value is None:
            return
        if not (
            isinstance(value, list)
            and value
            and all(
                isinstance(g, list) and g and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in g)
                for g in value
            )
        ):
            raise ShardConfigError(key, f"must be a list of lists of device ordinals, got {show_value(value)}.")
        return
    raise ShardConfigError(key, f"cannot be set from a config (value {show_value(value)}).")  # pragma: no cover


# ---------------------------------------------------------------- conversions (apply)


def fsdp_kwargs(config: ShardConfig) -> dict[str, Any]:
    """``XlaFullyShardedDataParallel``'s keyword arguments from a config :func:`check_fsdp_settings`
    accepted, converted as the Trainer converts them (``compute_dtype``/``buffer_dtype`` names become
    torch dtypes)."""
    out = {name: _convert(name, value) for name, value in config.xla_fsdp_settings.items()}
    out.setdefault("reshard_after_forward", config.reshard_after_forward)
    return out


def spmd_kwargs(config: ShardConfig) -> dict[str, Any]:
    """``SpmdFullyShardedDataParallel``'s keyword arguments: none (:func:`check_spmd_settings`)."""
    return {}


def cpu_fsdp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for XLA FSDP on several CPU devices: unpinned collective layouts (a pinned
    all_gather traces a different graph per device), and no sync inside backward (only the
    serialized step end may sync: ``sync_on_finalization`` is false by default, and
    :func:`check_cpu_fsdp_settings` refuses true)."""
    return {**kwargs, "pin_layout_in_collective_ops": False}


def _convert(name: str, value: Any) -> Any:
    if name in DTYPE_SETTINGS and value is not None:
        import torch

        return getattr(torch, dtype_name(name, value))
    return value
