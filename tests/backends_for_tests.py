"""Backends used by the registry tests, loaded by 'module:Class' exactly like a third-party one."""

from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from shardcore.distributed import TorchDistributedRuntime
from shardcore_fsdp2 import FSDP2Backend


class PlainBackend(TorchDistributedRuntime):
    """The required protocol only: no clipping, no accumulation control, no step end, no sharded
    checkpoints. Every rank keeps the whole model (nothing is sharded)."""

    name = "plain"
    install_hint = "nothing to install"
    supported_keys = frozenset({"auto_wrap_policy"})

    def apply(self, model, plan, config):
        return model

    # every rank holds everything: rank 0's state is the full one, and loading is a broadcast
    def full_state_dict(self, model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def load_full_state_dict(self, model, state_dict):
        model.load_state_dict(self.broadcast_object(state_dict))

    def full_optimizer_state_dict(self, model, optimizer):
        return get_optimizer_state_dict(model, optimizer)

    def load_full_optimizer_state_dict(self, model, optimizer, state):
        set_optimizer_state_dict(model, optimizer, self.broadcast_object(state))


class UnavailableBackend(PlainBackend):
    name = "unavailable"
    install_hint = "pip install shardcore-unavailable-example"
    supported_keys = frozenset()

    def is_available(self):
        return False, "its runtime library is not installed"


class OnlyWrapBackend(FSDP2Backend):
    """A backend that honours nothing but the wrap keys."""

    name = "only-wrap"
    supported_keys = frozenset({"auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params"})
