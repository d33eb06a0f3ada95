"""Reading each config source into a raw dict of keys as the user wrote them.

Readers translate a source's own conventions (accelerate's top-level ``mixed_precision``, the
Trainer's ``bf16``/``fsdp`` flags) and check only what belongs to the source itself (the YAML's
top-level keys and ``distributed_type``, a Trainer flag clashing with ``fsdp_config``). The config
keys are left as written, so every source goes through the same rules in :mod:`.fields` and a given
mistake gets the same message whichever source it came from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import ShardConfigError, UnknownKeyError
from .fields import as_bool, show_value
from .schema import ShardConfig

# Top-level keys of an accelerate config YAML that configure the launcher, not sharding. They are
# accepted (the same file drives `accelerate launch`) but do not change how a model is sharded.
_ACCELERATE_LAUNCHER_KEYS = {
    "compute_environment",
    "debug",
    "distributed_type",
    "downcast_bf16",
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
    "use_cpu",  # read: use_cpu
    "fsdp_config",
    "parallelism_config",
    "dynamo_config",  # read: torch_compile and its settings
}


def load_source(source: Any) -> dict[str, Any]:
    """The keys ``source`` holds, as written: names and values are checked later, by one set of rules."""
    if source is None:
        return {}
    if isinstance(source, ShardConfig):
        return source.to_dict()
    if isinstance(source, Mapping):
        raw = dict(source)
        if "parallelism_config" in raw:  # accelerate's section, nested in a dict config
            raw.update(parallelism_keys(raw.pop("parallelism_config"), "config"))
        return raw
    if isinstance(source, (str, os.PathLike)):
        return _load_file(Path(source))
    if _is_training_arguments(source):
        return _from_training_arguments(source)
    raise ShardConfigError(
        "config",
        f"cannot read a config from a {type(source).__name__}. Pass a dict, a path to a JSON or "
        "accelerate YAML file, a transformers.TrainingArguments or a ShardConfig.",
    )


#: accelerate ParallelismConfig sizes shardcore reads
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size")
#: and those it does not do: context and sequence parallelism
_OTHER_PARALLELISM = ("cp_size", "sp_size")
#: settings of those that accelerate writes even when they are off
_INERT_PARALLELISM = ("cp_backend", "sp_backend", "tp_handler", "cp_handler", "device_mesh")


def parallelism_keys(pc: Any, where: str) -> dict[str, Any]:
    """``dp_replicate_size`` / ``dp_shard_size`` / ``tp_size`` from accelerate's parallelism config:
    the YAML section (``parallelism_config_``-prefixed keys), a dict, or a ``ParallelismConfig``
    object (``TrainingArguments.parallelism_config``). Context or sequence parallelism is refused:
    a size > 1 would be silently ignored otherwise."""
    if pc is None:
        return {}
    if isinstance(pc, Mapping):
        items = {str(k).removeprefix("parallelism_config_"): v for k, v in pc.items()}
    elif hasattr(pc, "dp_replicate_size"):
        items = {k: getattr(pc, k, None) for k in (*_SIZES, *_OTHER_PARALLELISM)}
        if getattr(getattr(pc, "tp_handler", None), "enable_async_tp", False):
            raise ShardConfigError(
                "parallelism_config.tp_handler.enable_async_tp",
                f"is True in {where}, but shardcore's tensor parallelism runs its collectives synchronously (no "
                "async TP, which needs symmetric memory on CUDA). Set enable_async_tp=False.",
            )
    else:
        raise ShardConfigError(
            "parallelism_config", f"must be a mapping or an accelerate ParallelismConfig, got {show_value(pc)}."
        )
    out = {}
    for key, value in items.items():
        if key in _SIZES:
            if value is not None:
                out[key] = value
        elif key in _OTHER_PARALLELISM:
            if value is not None and value not in (1, "1"):
                raise ShardConfigError(
                    f"parallelism_config.{key}",
                    f"is {show_value(value)} in {where}, but shardcore does not do context or sequence parallelism "
                    "(it does FSDP, HSDP with dp_replicate_size, and tensor parallelism with tp_size). Set it to 1 or "
                    "remove it.",
                )
        elif key not in _INERT_PARALLELISM:
            raise UnknownKeyError(
                f"parallelism_config.{key}",
                [f"parallelism_config.{k}" for k in (*_SIZES, *_OTHER_PARALLELISM)],
                where=where,
            )
    return out


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
    raw.update(parallelism_keys(data.get("parallelism_config"), f"accelerate config {path}"))
    raw.update(dynamo_keys(data.get("dynamo_config"), f"accelerate config {path}"))
    if "use_cpu" in data:
        raw["use_cpu"] = data["use_cpu"]
    return raw


#: accelerate's dynamo_config keys -> shardcore's
_DYNAMO_KEYS = {
    "dynamo_backend": "torch_compile_backend",
    "dynamo_mode": "torch_compile_mode",
    "dynamo_use_fullgraph": "torch_compile_fullgraph",
    "dynamo_use_dynamic": "torch_compile_dynamic",
    "dynamo_use_regional_compilation": "torch_compile_regional",
}


def dynamo_keys(section: Any, where: str) -> dict[str, Any]:
    """The ``torch_compile`` keys of an accelerate YAML's ``dynamo_config`` section. ``dynamo_backend:
    NO`` (accelerate's "off", and what it writes when compilation was not chosen) turns compilation
    off, and the section's other keys are then inert there as here; any other backend turns it on."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ShardConfigError(
            "dynamo_config", f"must be a mapping of dynamo_ keys in {where}, got {show_value(section)}."
        )
    for key in section:
        if key not in _DYNAMO_KEYS:
            raise UnknownKeyError(f"dynamo_config.{key}", [f"dynamo_config.{k}" for k in _DYNAMO_KEYS], where=where)
    backend = section.get("dynamo_backend")
    if backend is None or (isinstance(backend, str) and backend.strip().upper() == "NO"):
        return {"torch_compile": False}
    out = {"torch_compile": True}
    for key, value in section.items():
        if value is not None:
            out[_DYNAMO_KEYS[key]] = value
    return out


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
    if trainer_ckpt and fsdp_ckpt is not None and as_bool("activation_checkpointing", fsdp_ckpt):
        raise ShardConfigError(
            "activation_checkpointing",
            "is true in fsdp_config and the TrainingArguments activation_checkpointing (or "
            "gradient_checkpointing) flag is also true; setting both raises an error (Transformers "
            "FSDP guide). Keep fsdp_config's activation_checkpointing only.",
        )
    raw.update(parallelism_keys(getattr(args, "parallelism_config", None), "TrainingArguments.parallelism_config"))
    if getattr(args, "use_cpu", False) or getattr(args, "no_cuda", False):  # no_cuda: its name before 4.38
        raw.setdefault("use_cpu", True)
    if getattr(args, "torch_compile", False):
        raw.setdefault("torch_compile", True)
        for key in ("torch_compile_backend", "torch_compile_mode"):
            if getattr(args, key, None) is not None:
                raw.setdefault(key, getattr(args, key))
    # Trainer fills its own defaults into fsdp_config (e.g. min_num_params 0, xla False); those that
    # equal ours are harmless, the rest are validated like any user key.
    return raw
