"""Loading a Transformers model straight into a sharded run.

With ``cpu_ram_efficient_loading`` no rank holds a full copy of the model. On a backend with
:class:`~shardcore.capabilities.SlicedLoading` every rank builds the model without weights, shards
it, and reads only its own slices of the safetensors files; elsewhere rank 0 reads the weights and
the other ranks build on the meta device and receive their shards from it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capabilities import SlicedLoading
from ..config import ShardConfig, parse_config
from ..errors import CheckpointError
from .keys import tied_names

log = logging.getLogger(__name__)


def from_pretrained(
    model_cls: Any,
    path: str | os.PathLike,
    config: Any = None,
    *,
    backend: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """``model_cls.from_pretrained(path, **kwargs)``, then :func:`shardcore.shard`.

    ``model_cls`` is a Transformers model class or Auto class (``AutoModelForCausalLM``); ``path``
    a local directory (a FULL shardcore checkpoint is one). With ``cpu_ram_efficient_loading: true``
    in ``config`` no rank reads the whole model:

    * on a backend that shards models without weights (FSDP2; ``SlicedLoading``), every rank builds the model from ``config.json``
      under :func:`shardcore.init_empty_weights`, shards it, and :func:`shardcore.load` reads only
      its own rows of each tensor from ``model.safetensors`` (or the shards of its index). Peak CPU
      memory per rank is about its shard. A checkpoint whose names need Transformers' own renaming
      is read the other way, below, with a warning.
    * otherwise only rank 0 reads the weights; every other rank builds the model on the meta
      device, and ``shard`` broadcasts rank 0's weights (and non-persistent buffers such as rotary
      ``inv_freq``) while sharding.

    Without the key every rank runs ``from_pretrained`` itself, as Transformers does.
    """
    from ..api import shard
    from ..backend import resolve_backend
    from ..distributed import env_world

    cfg = parse_config(config)
    confined(path)
    if cfg.cpu_ram_efficient_loading:
        chosen = resolve_backend(cfg, backend)
        if isinstance(chosen, SlicedLoading) and chosen.shards_without_weights(cfg):
            sliced = _sliced(model_cls, path, cfg, chosen, kwargs)
            if sliced is not None:
                return sliced
            backend = chosen
    rank = env_world()[0]
    if cfg.cpu_ram_efficient_loading and rank == 0 and not cfg.xla_fsdp_v2:
        # ranks that are not launcher processes (XLA FSDP's device threads) know their rank from the backend
        rank = resolve_backend(cfg, backend).world().rank
    with _BUILD_LOCK:
        model = _build_pretrained(model_cls, path, cfg, rank, kwargs)
    return shard(model, cfg, backend=backend)


def confined(path: Any) -> None:
    """Refuse a local directory whose files lead outside it (``..`` or absolute names in its index,
    symlinks to elsewhere), before Transformers reads it: its own loader joins the index's names to
    the directory as they come."""
    from . import full
    from .confine import inside

    src = Path(path)
    if not src.is_dir():
        return  # a hub name: the hub's cache layout is checked when the directory is read
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists() or (src / name).is_symlink():
            inside(src, name, "the model's config")
    if any((src / n).exists() or (src / n).is_symlink() for n in (full.WEIGHTS, full.WEIGHTS_INDEX)):
        full.weight_files(src)


def _sliced(model_cls: Any, path: Any, cfg: ShardConfig, backend: Any, kwargs: dict[str, Any]) -> nn.Module | None:
    """Build without weights on every rank, shard, read each rank's slices; None (rank-0 path)
    where the files are not safetensors or their names are not the model's."""
    from .. import empty
    from ..api import shard
    from . import full, keys, load

    src = Path(path)
    try:
        files = full.weight_files(src)
    except CheckpointError as e:
        log.warning("shardcore.from_pretrained: reading on rank 0 only, no sliced load here: %s", e)
        return None
    found = full.file_shapes(files)
    hf_config = _hf_config(path, kwargs)
    with _BUILD_LOCK:
        model = _from_config(
            model_cls, hf_config, kwargs, _auto_dtype(hf_config, files, kwargs), empty.init_empty_weights()
        )
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        keys.check_keys(wanted, found, tied_names(model), str(src))
    except CheckpointError as e:
        log.warning("shardcore.from_pretrained: reading on rank 0 only (Transformers renames these keys): %s", e)
        return None
    model = shard(model, cfg, backend=backend)
    load(model, src)
    return model.eval()  # as Transformers' from_pretrained returns it


def _auto_dtype(hf_config: Any, files: list[Path], kwargs: dict[str, Any]) -> Any:
    """The dtype Transformers' from_pretrained would give the model: the one asked for, or under its
    default ``"auto"`` the config's ``dtype``, else that of the checkpoint's first floating-point tensor."""
    asked = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if asked not in (None, "auto"):
        return asked
    if getattr(hf_config, "dtype", None) is not None:
        return hf_config.dtype
    from .full import file_tensors

    for ref in file_tensors(files).values():
        if ref.dtype is not None and ref.dtype.is_floating_point:
            return ref.dtype
    return None


def _hf_config(path: Any, kwargs: dict[str, Any]) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover - transformers is an extra
        raise CheckpointError("shardcore.from_pretrained needs transformers: pip install 'shardcore[hf]'.") from e
    return AutoConfig.from_pretrained(path, **{k: kwargs[k] for k in ("trust_remote_code",) if k in kwargs})


def _from_config(model_cls: Any, hf_config: Any, kwargs: dict[str, Any], dtype: Any, context: Any) -> nn.Module:
    build_kwargs = {k: kwargs[k] for k in ("attn_implementation", "trust_remote_code") if k in kwargs}
    if dtype is not None:
        build_kwargs["dtype"] = dtype
    build = getattr(model_cls, "from_config", None) or getattr(model_cls, "_from_config")
    with context:
        return build(hf_config, **build_kwargs)


# Device threads (XLA FSDP on CPU) may call from_pretrained at once, and Transformers' lazy module
# loading is not thread-safe; building one model at a time costs the other ranks nothing but a wait.
_BUILD_LOCK = threading.Lock()


def _build_pretrained(
    model_cls: Any, path: str | os.PathLike, cfg: ShardConfig, rank: int, kwargs: dict[str, Any]
) -> nn.Module:
    if cfg.cpu_ram_efficient_loading and rank != 0:
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        meta = torch.device("meta")
        return _from_config(model_cls, _hf_config(path, kwargs), kwargs, None if dtype == "auto" else dtype, meta)
    return model_cls.from_pretrained(path, **kwargs)
