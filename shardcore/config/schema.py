"""What a valid config *is*: the frozen dataclasses, every key's accepted spellings, and the FSDP1
keys refused by name. This module imports nothing else of the package, so the readers and validators
can all build on it without an import cycle."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: tensor-parallel styles shardcore applies, by transformers' names (``base_model_tp_plan`` values;
#: docs/tensor_parallel.md says what each splits). ``colwise_rep`` and ``rowwise_rep`` are transformers
#: 4.x's names of ``colwise_gather_output`` and ``rowwise_split_input``.
TP_STYLES = (
    "colwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise",
    "rowwise_split_input",
    "rowwise_rep",
    "embedding_rowwise",
    "embedding_colwise",
)
#: transformers styles shardcore knows and does not apply (yet): a plan naming one is refused, not
#: half applied
TP_STYLES_UNSUPPORTED = (
    "packed_colwise",
    "packed_rowwise",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "mla_kv_a_proj",
    "all_reduce",
    "moe_tp_experts",
    "moe_identity_expert",
    "local_params",
    "replicate",
    "grouped_gemm",
    "ep_dispatch_experts",
    "local_colwise",
    "local_rowwise",
    "local_packed_rowwise",
    "local",
    "gather",
    "isolated",
)
#: ``torch.compile``'s modes (``TrainingArguments.torch_compile_mode``, accelerate's ``dynamo_mode``)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the settings that only mean something with ``torch_compile`` on
COMPILE_SETTINGS = (
    "torch_compile_backend",
    "torch_compile_mode",
    "torch_compile_fullgraph",
    "torch_compile_dynamic",
    "torch_compile_regional",
)

# FSDP1 keys of TrainingArguments/accelerate. They are known, so they get a precise message instead
# of a did-you-mean, but FSDP2 has no such setting, so accepting them would silently ignore them.
FSDP1_ONLY_KEYS = {
    "backward_prefetch": "FSDP2 always prefetches the next all-gather in backward",
    "forward_prefetch": "FSDP2 has no forward prefetch setting",
    "limit_all_gathers": "FSDP2 limits in-flight all-gathers itself",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "sync_module_states": "use cpu_ram_efficient_loading to broadcast rank 0's weights",
    "sharding_strategy": "use reshard_after_forward (true = FULL_SHARD, false = SHARD_GRAD_OP)",
    "forward_prefetch_limit": "FSDP2 has no forward prefetch setting",
}


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2 ``MixedPrecisionPolicy`` in backend-neutral form (dtype names, not torch objects)."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None

    def torch_dtypes(self) -> dict[str, Any]:
        import torch

        return {k: (getattr(torch, v) if v is not None else None) for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class ShardConfig:
    """Validated sharding settings. Build it with :func:`parse_config`, not by hand.

    ``explicit`` is the set of keys the user wrote; backends are checked against keys whose value
    differs from the default, so a ``TrainingArguments`` that fills in ``xla: False`` everywhere still
    works with FSDP2.
    """

    version: int = 2
    backend: str | None = None
    reshard_after_forward: bool = True
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    transformer_layer_cls_to_wrap: tuple[str, ...] = ()
    min_num_params: int = 0
    cpu_offload: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    # checkpoints of the Trainer's save_strategy and of a CheckpointManager (its default) are written
    # in the background once the state is in CPU memory
    async_save: bool = False
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    mixed_precision: MixedPrecision | None = None
    xla: bool = False
    xla_fsdp_v2: bool = False
    xla_fsdp_settings: Mapping[str, Any] = field(default_factory=dict)
    xla_fsdp_grad_ckpt: bool = False
    timeout: float = 1800.0
    # accelerate's ParallelismConfig meanings: None = decided from the world size (both None: pure
    # sharding over every rank); dp_replicate_size x dp_shard_size must equal the world size
    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    # tensor parallelism (accelerate's ParallelismConfig.tp_size): the innermost mesh dim;
    # dp_replicate_size x dp_shard_size x tp_size is the world size. tp_plan None is "auto" (the
    # model's own plan) when tp_size > 1; otherwise a mapping of module-name pattern -> style
    tp_size: int = 1
    tp_plan: Any = None
    # TrainingArguments' torch_compile keys and accelerate's dynamo_config: each sharding unit is
    # compiled in place (regional), or with torch_compile_regional false the whole model
    torch_compile: bool = False
    torch_compile_backend: str | None = None  # None: torch.compile's default, inductor
    torch_compile_mode: str | None = None
    torch_compile_fullgraph: bool = False
    torch_compile_dynamic: bool | None = None
    torch_compile_regional: bool = True
    # TrainingArguments' and an accelerate YAML's use_cpu: train on the CPU even where torch reports
    # an accelerator (the explicit way; shardcore never falls back to the CPU on its own)
    use_cpu: bool = False
    explicit: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)

    @property
    def backend_name(self) -> str:
        """The backend this config selects: ``backend`` if given, ``xla`` if ``xla: true``, else FSDP2."""
        if self.backend is not None:
            return self.backend
        return "xla" if self.xla else "fsdp2"

    def non_default_keys(self) -> list[str]:
        """Keys whose value differs from the default: what a backend must be able to honour."""
        defaults = ShardConfig()
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("explicit", "version", "backend") and getattr(self, f.name) != getattr(defaults, f.name)
        ]

    def replace(self, **changes: Any) -> "ShardConfig":
        """A new validated config with ``changes`` applied (same rules as :func:`parse_config`)."""
        from . import parse_config  # the parser needs this class, so it can only be reached at call time

        raw = self.to_dict()
        raw.update(changes)
        return parse_config(raw)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable) that :func:`parse_config` reads back unchanged."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "explicit":
                continue
            v = getattr(self, f.name)
            if isinstance(v, MixedPrecision):
                v = {k: x for k, x in dataclasses.asdict(v).items() if x is not None}
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        if out["backend"] is None:
            del out["backend"]
        if out["mixed_precision"] is None:
            del out["mixed_precision"]
        for key in ("torch_compile_backend", "torch_compile_mode", "torch_compile_dynamic"):
            if out[key] is None:
                del out[key]
        return out


# Aliases: other spellings of a key, mapped to the canonical name.
KEY_ALIASES = {
    "offload_params": "cpu_offload",  # accelerate's fsdp_offload_params
    "mixed_precision_policy": "mixed_precision",  # accelerate's FullyShardedDataParallelPlugin field
    "activation_checkpointing": "activation_checkpointing",
    "xla_fsdp_config": "xla_fsdp_settings",
}

FIELD_NAMES = {f.name for f in dataclasses.fields(ShardConfig)} - {"explicit"}


def known_keys() -> set[str]:
    """Every key a config dict may hold (canonical names and aliases, without ``fsdp_`` prefixes)."""
    return FIELD_NAMES | set(KEY_ALIASES)
