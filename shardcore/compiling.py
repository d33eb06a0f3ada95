"""``torch_compile``: compile sharding units in place, for backends that run torch's eager autograd.

The unit's ``forward`` is replaced, on the instance, by its compiled version. The module object
stays, so parameter names and state-dict keys stay (no ``_orig_mod.``), and the hooks a sharding
API puts on the module later (``fully_shard``'s all-gather and reduce-scatter) run around the
compiled region, eagerly, exactly as without compilation: the compiled graph holds the unit's
computation and nothing of the sharding, and can be one graph (``torch_compile_fullgraph``).
Compiling ``__call__`` instead (``nn.Module.compile``) would put those hooks inside the traced
region, where dynamo skips them with graph breaks. torchtitan's order: activation checkpointing,
then compilation, then sharding.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import ShardConfig
from .plan import WrapPlan


def compile_kwargs(config: ShardConfig) -> dict[str, Any]:
    """``torch.compile`` keyword arguments from the config's ``torch_compile_*`` keys."""
    kwargs: dict[str, Any] = {"fullgraph": config.torch_compile_fullgraph, "dynamic": config.torch_compile_dynamic}
    if config.torch_compile_backend is not None:
        kwargs["backend"] = config.torch_compile_backend
    if config.torch_compile_mode is not None:
        kwargs["mode"] = config.torch_compile_mode
    return kwargs


def compile_targets(model: nn.Module, plan: WrapPlan, config: ShardConfig) -> list[nn.Module]:
    """What ``torch_compile`` compiles: each unit of the plan (regional compilation); the root
    module when the plan has no other unit (NO_WRAP), or when ``torch_compile_regional`` is false
    (accelerate's whole-model compilation). Empty when ``torch_compile`` is off."""
    if not config.torch_compile:
        return []
    units = plan.modules(model)
    if config.torch_compile_regional and units:
        return units
    return [model]


def compile_in_place(module: nn.Module, config: ShardConfig) -> None:
    import torch

    module.forward = torch.compile(module.forward, **compile_kwargs(config))  # type: ignore[method-assign]
    module._shardcore_compiled = True  # type: ignore[attr-defined]
