"""Loading a Transformers model straight into a sharded run.

With ``cpu_ram_efficient_loading`` every rank but 0 builds the model on the meta device instead
of reading the weights, so a node does not hold one full copy of the model per process.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch import nn

from ..config import ShardConfig, parse_config
from ..errors import CheckpointError


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
    in ``config`` only rank 0 reads the weights; every other rank builds the model from its
    ``config.json`` on the meta device, and ``shard`` broadcasts rank 0's weights (and non-persistent
    buffers such as rotary ``inv_freq``) while sharding. Peak CPU memory on those ranks is then about
    their shard, not the whole model.
    """
    from ..api import shard
    from ..distributed import env_world

    cfg = parse_config(config)
    rank = env_world()[0]
    if cfg.cpu_ram_efficient_loading and rank == 0 and not cfg.xla_fsdp_v2:
        # ranks that are not launcher processes (XLA FSDP's device threads) know their rank from the backend
        from ..backend import resolve_backend

        rank = resolve_backend(cfg, backend).world().rank
    with _BUILD_LOCK:
        model = _build_pretrained(model_cls, path, cfg, rank, kwargs)
    return shard(model, cfg, backend=backend)


# Device threads (XLA FSDP on CPU) may call from_pretrained at once, and Transformers' lazy module
# loading is not thread-safe; building one model at a time costs the other ranks nothing but a wait.
_BUILD_LOCK = threading.Lock()


def _build_pretrained(
    model_cls: Any, path: str | os.PathLike, cfg: ShardConfig, rank: int, kwargs: dict[str, Any]
) -> nn.Module:
    if cfg.cpu_ram_efficient_loading and rank != 0:
        try:
            from transformers import AutoConfig
        except ImportError as e:  # pragma: no cover - transformers is an extra
            raise CheckpointError("shardcore.from_pretrained needs transformers: pip install 'shardcore[hf]'.") from e
        hf_config = AutoConfig.from_pretrained(path)
        build_kwargs = {
            k: kwargs[k] for k in ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code") if k in kwargs
        }
        build = getattr(model_cls, "from_config", None) or getattr(model_cls, "_from_config")
        with torch.device("meta"):
            return build(hf_config, **build_kwargs)
    return model_cls.from_pretrained(path, **kwargs)
