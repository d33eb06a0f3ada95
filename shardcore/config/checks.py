"""Cross-key checks, run on the built ``ShardConfig`` once every key has passed on its own. Keys that
are each valid can still contradict each other or leave one without effect; both are refused,
because a setting that is silently ignored is the failure shardcore exists to prevent."""

from __future__ import annotations

from ..errors import ShardConfigError
from .fields import show_value
from .schema import COMPILE_SETTINGS, ShardConfig


def check_combinations(cfg: ShardConfig) -> None:
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
    if cfg.tp_plan is not None and cfg.tp_size == 1:
        raise ShardConfigError(
            "tp_plan",
            f"is {show_value(cfg.tp_plan)} but tp_size is 1, so nothing is split. Set tp_size (the ranks of one "
            "tensor-parallel group) or remove tp_plan.",
        )
    if not cfg.torch_compile:
        defaults = ShardConfig()
        for key in COMPILE_SETTINGS:
            if getattr(cfg, key) != getattr(defaults, key):
                raise ShardConfigError(
                    key,
                    f"is {show_value(getattr(cfg, key))} but torch_compile is false, so nothing is compiled. Set "
                    f"torch_compile: true or remove {key}.",
                )
