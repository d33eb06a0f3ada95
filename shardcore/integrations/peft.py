"""PEFT models (``peft.get_peft_model``: LoRA and the other adapters PEFT wraps a model in).

The core never imports peft: a model is recognised by its class's module, and peft is imported here
only for a model that is one. The wrap plan needs nothing from here (it finds the base model's
``_no_split_modules`` through PEFT's wrappers, so the frozen base and its adapters share units).
What PEFT changes is what a FULL checkpoint is: what ``PeftModel.save_pretrained`` writes, the
adapter's config and weights under PEFT's own key names, or, merged, a plain Transformers model with
the adapters folded into its weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError

#: the files of an adapter directory (peft.utils.SAFETENSORS_WEIGHTS_NAME, CONFIG_NAME)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_peft_model(model: Any) -> bool:
    """A ``peft.PeftModel`` (or subclass), told without importing peft."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(model).__mro__)


def peft_of(model: Any) -> Any | None:
    """The PEFT model ``model`` is, or wraps (XLA's wrappers put the root inside one), or None."""
    if is_peft_model(model):
        return model
    return next((m for m in model.modules() if is_peft_model(m)), None) if isinstance(model, nn.Module) else None


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def _adapter_name(model: Any) -> str:
    name = model.active_adapter
    if not isinstance(name, str):  # several active adapters: PEFT saves each; shardcore saves one
        raise CheckpointError(
            f"shardcore.save: this PEFT model has several active adapters ({name!r}); save one at a time "
            "(model.set_adapter(name)) or save with state_dict_type='SHARDED_STATE_DICT'."
        )
    return name


#: attribute of a PEFT model that :func:`remember_keys` sets: adapter name -> key map
_KEYS_ATTR = "_shardcore_peft_keys"


def _peft_key_map(model: Any, keys: list[str], adapter: str) -> dict[str, str]:
    """PEFT's adapter key -> the model's key, as ``get_peft_model_state_dict`` maps them (it is run on
    placeholders, so PEFT's own rules decide which keys belong to the adapter and how they are named).
    PEFT finds the adapter's layers by module name, so ``model`` must not be wrapped yet."""
    from peft import get_peft_model_state_dict

    marks = {k: torch.tensor(i) for i, k in enumerate(keys)}
    picked = get_peft_model_state_dict(model, state_dict=marks, adapter_name=adapter)
    return {k: keys[int(v)] for k, v in picked.items()}


def remember_keys(model: Any) -> None:
    """Before sharding: each adapter's key map, from the model's own names. A backend's wrappers may
    rename modules (XLA FSDP nests ``_fsdp_wrapped_module._fpw_module``), which PEFT's own selection
    would then miss; checkpoints keep speaking the original names."""
    keys = list(model.state_dict().keys())
    maps = {name: _peft_key_map(model, keys, name) for name in model.peft_config}
    object.__setattr__(model, _KEYS_ATTR, maps)


def _key_map(model: Any, keys: list[str], adapter: str) -> dict[str, str]:
    remembered = getattr(model, _KEYS_ATTR, {}).get(adapter)
    return remembered if remembered is not None else _peft_key_map(model, keys, adapter)


def adapter_state(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's weights of a full (gathered) state dict, under PEFT's key names."""
    mapping = _key_map(model, list(state), _adapter_name(model))
    return {k: state[m].detach().cpu().contiguous() for k, m in mapping.items()}


def write_adapter_config(tmp: Path, model: Any) -> None:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (inference mode on)."""
    # shallow: a deep copy rebuilds target_modules, a set, and the copy can iterate in another order
    # than the original (it depends on the hash seed), so the file's list would differ from PEFT's
    cfg = copy.copy(model.peft_config[_adapter_name(model)])
    cfg.inference_mode = True
    cfg.save_pretrained(str(tmp))


def load_keys(model: Any, adapter_keys: list[str], model_keys: list[str], src: Path) -> dict[str, str]:
    """The model's key for each key of an adapter file; a key the model has no place for, or an
    adapter weight of the model that the file lacks, is a CheckpointError."""
    mapping = _key_map(model, model_keys, _adapter_name(model))
    unknown = sorted(set(adapter_keys) - set(mapping))
    missing = sorted(set(mapping) - set(adapter_keys))
    if unknown or missing:
        raise CheckpointError(
            f"shardcore.load({str(src)!r}): the adapter does not fit this PEFT model: "
            f"{len(unknown)} key(s) it has no place for (e.g. {unknown[:3]}), {len(missing)} of its adapter "
            f"weights missing (e.g. {missing[:3]}). Build the model with the adapter's LoraConfig "
            f"({ADAPTER_CONFIG} in that directory)."
        )
    return mapping


def merged_model(model: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """A single-device copy of the base model with the adapter folded into its weights (PEFT's
    ``merge_and_unload``), from the full state dict of the sharded PEFT model. Rank 0 only."""
    from peft import get_peft_model

    base = model.get_base_model()
    config = getattr(base, "config", None)
    if config is None:
        raise CheckpointError(
            f"shardcore.save(merged=True): the base model {type(base).__name__} has no config to rebuild it from; "
            "merged export needs a Transformers model."
        )
    fresh = type(base)(copy.deepcopy(config))
    adapter = _adapter_name(model)
    peft_config = copy.deepcopy(model.peft_config[adapter])
    peft_config.inference_mode = False
    wrapped = get_peft_model(fresh, peft_config, adapter_name=adapter)
    wrapped.load_state_dict(state, strict=True)
    return wrapped.merge_and_unload()
