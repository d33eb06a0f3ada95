"""Every check of a config against a model and a backend, in one place, before anything is sharded.

:func:`shardcore.shard` runs :func:`validate` after it has parsed the config, picked the backend
(which refuses keys it does not support) and built the wrap plan, and before ``Backend.apply``. So
``apply`` gets a config it can carry out and never raises :class:`ShardConfigError`; a model is never
left half sharded by a config mistake. Backends extend the checks through two capabilities:
:class:`~shardcore.capabilities.ConfigValidation` (the config alone, no devices or other ranks) and
:class:`~shardcore.capabilities.ModelValidation` (this model, and the other ranks' models through
collectives, ending in one verdict on every rank with :func:`agree`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .capabilities import ConfigValidation, ModelValidation
from .config import ShardConfig
from .errors import ShardConfigError, UnsupportedKeyError, WrapPlanError
from .plan import WrapPlan

#: name -> (shape, dtype name) of every parameter and buffer, tied ones under each name
Layout = dict[str, tuple[tuple[int, ...], str]]


def validate(model: nn.Module, plan: WrapPlan, config: ShardConfig, backend: Any) -> None:
    """Raise :class:`ShardConfigError` (naming the key, the value and the fix) for anything that
    ``backend.apply(model, plan, config)`` could not carry out. (:func:`check_supported_keys` has
    run already, when the backend was resolved.)"""
    check_checkpointing_not_twice(model, config)
    check_units_to_checkpoint(plan, config)
    check_not_quantized(model)
    if isinstance(backend, ConfigValidation):
        backend.validate(config)
    if isinstance(backend, ModelValidation):
        backend.validate_model(model, plan, config)


def check_supported_keys(config: ShardConfig, backend: Any) -> None:
    """Nothing is silently ignored: a key set away from its default that the backend does not list
    in ``supported_keys`` is refused. Runs when the backend is resolved, before the plan is built."""
    unsupported = [k for k in config.non_default_keys() if k not in backend.supported_keys]
    if unsupported:
        key = unsupported[0]
        # a backend may say why it refuses a key (Backend.unsupported_reasons)
        why = getattr(backend, "unsupported_reasons", {}).get(key)
        raise UnsupportedKeyError(
            key,
            f"{getattr(config, key)!r} is not supported by the {backend.name!r} backend (unsupported "
            f"here: {', '.join(unsupported)}). {why + ' ' if why else ''}Remove the key or pick a backend that "
            "supports it.",
        )


def data_parallel_shape(config: ShardConfig, world_size: int) -> tuple[int, int]:
    """``(dp_replicate_size, dp_shard_size)`` for ``world_size`` ranks, accelerate's meanings: the
    ranks not in one tensor-parallel group (``tp_size``, the innermost dim) are data-parallel; both
    unset is pure sharding over all of those; one set decides the other; both set must multiply to
    them. Every rank computes the same answer, so every rank raises the same error."""
    tp = config.tp_size
    if world_size % tp:
        raise ShardConfigError(
            "tp_size",
            f"is {tp} but the world size {world_size} is not a multiple of it, so the ranks do not form whole "
            f"tensor-parallel groups. Use a divisor of {world_size}, or launch a multiple of {tp} ranks.",
        )
    ranks = world_size // tp
    times_tp = f" x tp_size {tp}" if tp > 1 else ""
    whose = (
        f"world size {world_size}"
        if tp == 1
        else f"data-parallel size {ranks} (world size {world_size} / tp_size {tp})"
    )
    r, s = config.dp_replicate_size, config.dp_shard_size
    if r is None and s is None:
        return 1, ranks
    given = "dp_replicate_size" if r is not None else "dp_shard_size"
    if r is None or s is None:
        if ranks % (r or s):
            raise ShardConfigError(
                given,
                f"is {r or s} but the {whose} is not a multiple of it, so no dp_replicate_size x "
                f"dp_shard_size{times_tp} mesh covers the ranks. Use a divisor of {ranks}, or launch a multiple of "
                f"{(r or s) * tp} ranks.",
            )
        r, s = (r, ranks // r) if r is not None else (ranks // s, s)
    if r * s != ranks:
        raise ShardConfigError(
            "dp_replicate_size",
            f"is {r} and dp_shard_size is {s}, which make {r * s * tp} ranks{' with tp_size ' + str(tp) if tp > 1 else ''}, "
            f"but the world size is {world_size}. Set them so that dp_replicate_size x dp_shard_size{times_tp} equals "
            "the number of ranks (or set only one).",
        )
    return r, s


def _checkpointing_key(config: ShardConfig) -> str | None:
    if config.activation_checkpointing:
        return "activation_checkpointing"
    return "xla_fsdp_grad_ckpt" if config.xla_fsdp_grad_ckpt else None


def check_checkpointing_not_twice(model: nn.Module, config: ShardConfig) -> None:
    """Transformers refuses its own gradient checkpointing on top of FSDP's (its FSDP guide)."""
    key = _checkpointing_key(config)
    # Transformers 5 renamed is_gradient_checkpointing; read the old name only where the new is absent
    attr = (
        "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    )
    if key and getattr(model, attr, False) is True:
        raise ShardConfigError(
            key,
            f"is true but {type(model).__name__} already has gradient checkpointing enabled "
            "(gradient_checkpointing_enable()); setting both raises an error (Transformers FSDP "
            f"guide). Call model.gradient_checkpointing_disable() or drop {key}.",
        )


def check_units_to_checkpoint(plan: WrapPlan, config: ShardConfig) -> None:
    """Activation checkpointing recomputes units; a plan without units would silently do nothing."""
    key = _checkpointing_key(config)
    if key and not plan.units:
        raise ShardConfigError(
            key,
            f"is true but auto_wrap_policy {config.auto_wrap_policy} gives no units to checkpoint. Use "
            "TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP, or drop the key.",
        )


def layout(model: nn.Module) -> Layout:
    """What must agree between ranks for rank 0's weights to fill every rank's shards."""
    tensors = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    return {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()}


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def check_rank0_weights(
    model: nn.Module,
    rank: int,
    broadcast_object: Callable[[Any], Any],
    all_gather_object: Callable[[Any], list[Any]],
    *,
    weights_later: bool = False,
) -> Layout:
    """``cpu_ram_efficient_loading`` on several ranks: rank 0 holds real weights and every rank's
    model has rank 0's names and shapes (the others may be on the meta device). With
    ``weights_later`` (a backend with :class:`~shardcore.capabilities.SlicedLoading`) every rank may
    instead hold a model without weights (:func:`shardcore.init_empty_weights`), to be filled by
    :func:`shardcore.load`. Collective: every rank calls it, and every rank raises the same error.
    Returns rank 0's layout (its dtypes are the ones every rank shards)."""
    from .empty import weights_state

    mine = layout(model)
    rank0_layout = broadcast_object(mine)
    states = all_gather_object(weights_state(model))
    problem = None
    if weights_later and all(s == "empty" for s in states):
        pass
    elif states[0] != "real":
        problem = "is true but rank 0's model has tensors on the meta device. Rank 0 must hold the real weights " + (
            "(from_pretrained there; the other ranks may build the model on the meta device), or every rank "
            "must build the model without weights under shardcore.init_empty_weights() (parameters on meta, "
            "buffers real) and call shardcore.load() after shard()."
            if weights_later
            else "(from_pretrained there); the other ranks may build the model on the meta device."
        )
    if problem is None and {k: v[0] for k, v in mine.items()} != {k: v[0] for k, v in rank0_layout.items()}:
        diff = sorted(set(mine.items()) ^ set(rank0_layout.items()))[:3]
        problem = (
            f"is true but rank {rank}'s model differs from rank 0's (names or shapes: {diff}). Build the same "
            "model from the same config on every rank."
        )
    agree("cpu_ram_efficient_loading", problem, all_gather_object)
    return rank0_layout


def agree(key: str, problem: str | None, all_gather_object: Callable[[Any], list[Any]]) -> None:
    """One verdict on every rank: each rank passes its own problem (or None), and every rank
    raises the first rank's problem if any rank has one, so no rank waits for a rank that raised."""
    bad = next((p for p in all_gather_object(problem) if p), None)
    if bad:
        raise ShardConfigError(key, bad)


def check_uniform_unit_dtypes(model: nn.Module, plan: Any) -> None:
    """For a backend that shards each unit's parameters as one buffer of one dtype (FSDP2: "FSDP
    expects uniform original parameter dtype"): a unit with two dtypes, such as a bf16 base with fp32
    LoRA adapters (PEFT's ``autocast_adapter_dtype``), is refused, naming a parameter of each."""
    params = dict(model.named_parameters())
    for unit in plan.all_units():
        seen: dict[torch.dtype, str] = {}
        for n in unit.param_names:
            p = params.get(n)
            if p is not None and p.is_floating_point():
                seen.setdefault(p.dtype, n)
        if len(seen) > 1:
            (a, na), (b, nb) = list(seen.items())[:2]
            where = f"unit {unit.path!r}" if unit.path else "the root unit"
            raise WrapPlanError(
                "parameter dtypes",
                f"{where} holds parameters of two dtypes: {na} is {str(a).removeprefix('torch.')} and {nb} is "
                f"{str(b).removeprefix('torch.')}. FSDP2 shards a unit's parameters in one dtype. Give them one: "
                "get_peft_model(model, config, autocast_adapter_dtype=False) keeps the adapters in the base's dtype, "
                "or load the base in float32 and set mixed_precision: bf16 to compute in bf16.",
            )


def check_not_quantized(model: nn.Module) -> None:
    """Quantized base weights (bitsandbytes 4-bit, torchao NF4) are not sharded yet: refused by name."""
    for n, p in model.named_parameters():
        kind = type(p).__name__
        data = type(getattr(p, "data", p)).__name__
        if kind in ("Params4bit", "Int8Params") or data in ("NF4Tensor", "AffineQuantizedTensor"):
            raise WrapPlanError(
                "quantized weights",
                f"parameter {n} is quantized ({kind if kind != 'Parameter' else data}); shardcore does not shard "
                "quantized bases yet (QLoRA). Load the base unquantized (bf16 or fp32) to train LoRA with shardcore.",
            )
