"""Backends used by the registry tests, loaded by 'module:Class' exactly like a third-party one."""
from shardcore.distributed import TorchDistributedRuntime
from shardcore_fsdp2 import FSDP2Backend


class UnavailableBackend:
    name = "unavailable"
    install_hint = "pip install shardcore-unavailable-example"
    supported_keys = frozenset()

    def is_available(self):
        return False, "its runtime library is not installed"


class OnlyWrapBackend(FSDP2Backend):
    """A backend that honours nothing but the wrap keys."""

    name = "only-wrap"
    supported_keys = frozenset({"auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params"})


class PlainBackend(TorchDistributedRuntime):
    """The required protocol only: no clipping, no accumulation control, no step end."""

    name = "plain"
    install_hint = "nothing to install"
    supported_keys = frozenset({"auto_wrap_policy"})

    def apply(self, model, plan, config):
        return model
