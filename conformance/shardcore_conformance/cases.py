"""Conformance cases: a model, a config and a short training schedule, all deterministic.

:func:`matrix_for` builds the case matrix of one backend from the config keys it declares
(``backend.supported_keys``): every declared key is a dimension, so a backend that honours fewer
keys gets fewer cases, and a key it does not declare is never set.

- Structural keys are crossed with each other on every model: ``auto_wrap_policy`` (three
  policies; SIZE_BASED_WRAP through ``min_num_params``), ``reshard_after_forward``,
  ``activation_checkpointing``, ``xla_fsdp_v2``, ``xla_fsdp_grad_ckpt``.
- Every other key gets its own cases on the default structure (``cpu_offload``,
  ``mixed_precision``, ``xla_fsdp_settings`` compute dtype, ``transformer_layer_cls_to_wrap``,
  ``state_dict_type``, ``cpu_ram_efficient_loading``, ``timeout``, ``use_cpu``).
- Feature cases run for every backend, with only the keys it declares: frozen parameters,
  buffers, uneven shards, gradient accumulation (through ``shardcore.no_sync``), a learning-rate
  schedule.
- Capability cases run for every backend that declares the capability: gradient clipping
  (``shardcore.capabilities.GradClipping``), crossed with the structural keys, ``inf`` norm, frozen and
  unused parameters, accumulation, CPU offload and bf16.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .models import MODELS

#: checkpoint cases save after this many of their steps and resume from it
RESUME_AT = 2
#: the global batch of every case is this many rows per rank (times the world size)
PER_RANK_BATCH = 4
#: low-precision cases train at a lower lr: AdamW turns a bf16-rounded gradient of the wrong sign
#: into a full-size step, so the parameter drift per step scales with lr
LOW_PRECISION_LR = 1e-3


@dataclass(frozen=True)
class Case:
    """One training run, done once on a single device and once sharded.

    ``global_batch`` rows per optimizer step, split into ``grad_accum`` micro-batches (each
    divided among the ranks by the backend's ``local_batch``; all but the last inside
    ``shardcore.no_sync``); ``max_grad_norm`` set: gradients clipped to that ``norm_type`` norm
    before each step (``shardcore.clip_grad_norm_``); ``lr_schedule`` is ``"constant"`` or
    ``"warmup_cosine"``; parameters whose names match a ``frozen`` pattern get
    ``requires_grad=False`` before sharding. ``family`` groups cases in the report.
    ``empty_weights``: every rank builds the model without weights
    (``shardcore.init_empty_weights``), shards it, and loads the seed's weights from a FULL
    checkpoint with ``shardcore.load`` (sliced reading, ``SlicedLoading``). ``resume_at`` k > 0: the
    sharded run saves the model and optimizer after k steps, then trains on from a new model and
    optimizer that loaded them; it must match the reference, which trains without a break.
    """

    name: str
    model: str
    config: dict[str, Any] = field(default_factory=dict)
    steps: int = 5
    global_batch: int = 8
    seed: int = 0
    lr: float = 1e-2
    dtype: str = "fp32"
    grad_accum: int = 1
    lr_schedule: str = "constant"
    frozen: tuple[str, ...] = ()
    family: str = ""
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    empty_weights: bool = False
    resume_at: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"case {self.name!r}: unknown model {self.model!r}; known: {', '.join(MODELS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"case {self.name!r}: lr_schedule {self.lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}")
        if not 0 <= self.resume_at < self.steps:
            raise ValueError(f"case {self.name!r}: resume_at {self.resume_at} is not a step of 0..{self.steps - 1}")
        if self.grad_accum < 1 or self.global_batch % self.grad_accum:
            raise ValueError(
                f"case {self.name!r}: global_batch {self.global_batch} is not a multiple of grad_accum {self.grad_accum}"
            )
        object.__setattr__(self, "frozen", tuple(self.frozen))
        if not self.family:
            object.__setattr__(self, "family", self.model)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Case":
        return cls(**d)


LR_SCHEDULES = ("constant", "warmup_cosine")

# Keys crossed with each other (value tried besides the default), in name order.
_TOGGLES = (
    ("reshard_after_forward", "reshard", True),
    ("activation_checkpointing", "ac", False),
    ("xla_fsdp_v2", "v2", False),
    ("xla_fsdp_grad_ckpt", "gc", False),
)
# Which parameters the frozen cases freeze: a whole unit plus part of the root (and, for GPT-2, part
# of a unit). The tied GPT-2 embedding stays trainable, so the head keeps training.
_FROZEN = {
    "mlp": ("blocks.0.*", "head.bias"),
    "llama": ("model.embed_tokens.*", "model.layers.0.*"),
    "gpt2": ("transformer.wpe.*", "transformer.h.0.attn.*"),
}
_LAYER_CLS = {"mlp": "MLPBlock", "llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}
STRUCTURAL_MODELS = ("mlp", "llama", "gpt2")


def supported_keys(backend: Any) -> frozenset[str]:
    """``backend.supported_keys`` of a backend object, registered name or ``module:Class``."""
    if isinstance(backend, str):
        import shardcore

        backend = shardcore.get_backend(backend)
    return frozenset(backend.supported_keys)


def _wraps(model: str, keys: frozenset[str]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [
        ("transformer", {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"} if "auto_wrap_policy" in keys else {})
    ]
    if "auto_wrap_policy" not in keys:
        return out
    size = MODELS[model].size_wrap_min_params
    if size is not None and "min_num_params" in keys:
        # (tied GPT-2 has none: a unit with the input embedding shares it with the head outside)
        out.append(("size", {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": size}))
    out.append(("nowrap", {"auto_wrap_policy": "NO_WRAP"}))
    return out


def low_precision_knob(keys: frozenset[str]) -> dict[str, Any] | None:
    """The config that makes a backend compute in bf16, from the keys it declares (None: none)."""
    if "mixed_precision" in keys:
        return {"mixed_precision": "bf16"}
    if "xla_fsdp_settings" in keys:
        return {"xla_fsdp_settings": {"compute_dtype": "bfloat16"}}
    return None


def matrix_for(backend: Any, world_size: int = 2, dtype: str | None = None) -> list[Case]:
    """The conformance cases for ``backend``: :func:`_matrix` less the combinations the backend
    refuses (ConfigValidation: its ``validate(config)`` raises ShardConfigError, e.g. XLA's SPMD
    with ``reshard_after_forward: false``). Each left-out case is logged with the backend's reason.
    ``backend``: a registered name or ``module:Class`` (loaded and checked), or an object, of which
    the matrix reads only ``supported_keys`` and the capabilities it is an instance of."""
    import logging

    import shardcore
    from shardcore.capabilities import ConfigValidation

    log = logging.getLogger(__name__)
    obj = shardcore.get_backend(backend) if isinstance(backend, str) else backend
    kept = []
    for c in _matrix(obj, world_size, dtype):
        if isinstance(obj, ConfigValidation):
            try:
                obj.validate(shardcore.parse_config(c.config))
            except shardcore.ShardConfigError as e:
                log.info("left out: %s (the backend refuses the combination: %s)", c.name, e)
                continue
        kept.append(c)
    return kept


def _matrix(backend: Any, world_size: int = 2, dtype: str | None = None) -> list[Case]:
    """The conformance cases for ``backend`` (object, registered name or ``module:Class``).

    ``dtype`` None: the fp32 matrix plus bf16 cases for each low-precision key the backend declares
    (what CI runs). ``"fp32"``: only the fp32 cases. ``"bf16"``: every fp32 case again with the
    backend's low-precision key set (``mixed_precision: bf16``, else ``xla_fsdp_settings``
    ``compute_dtype: bfloat16``); a ValueError if it declares neither.
    """
    if dtype not in (None, "fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16, got {dtype!r}")
    keys = supported_keys(backend)
    gb = PER_RANK_BATCH * world_size
    base: dict[str, Any] = {"xla": True} if "xla" in keys else {}
    fp32: list[Case] = []

    def add(name: str, model: str, cfg: dict[str, Any], **kw: Any) -> None:
        fp32.append(Case(name, model, {**base, **cfg}, global_batch=gb, **kw))

    toggles = [(k, tag, default) for k, tag, default in _TOGGLES if k in keys]
    for model in STRUCTURAL_MODELS:
        for (wrap, wcfg), values in itertools.product(
            _wraps(model, keys), itertools.product(*[(d, not d) for _, _, d in toggles])
        ):
            cfg = dict(wcfg)
            tags = [model, wrap]
            for (key, tag, _), v in zip(toggles, values):
                cfg[key] = v
                tags.append(f"{tag}{int(v)}")
            checkpointing = cfg.get("activation_checkpointing") or cfg.get("xla_fsdp_grad_ckpt")
            if checkpointing and wrap == "nowrap":
                continue  # activation checkpointing needs units to checkpoint; NO_WRAP has none
            if cfg.get("activation_checkpointing") and cfg.get("xla_fsdp_grad_ckpt"):
                continue  # two ways of asking for the same recomputation
            add("-".join(tags), model, cfg)

    # one-off knobs on the default structure
    if "cpu_offload" in keys:
        for model in ("mlp", "llama"):
            add(f"{model}-cpu_offload", model, {"cpu_offload": True}, family="cpu_offload")
    if "transformer_layer_cls_to_wrap" in keys:
        for model in ("llama", "gpt2"):
            add(f"{model}-layer_cls", model, {"transformer_layer_cls_to_wrap": [_LAYER_CLS[model]]}, family="layer_cls")
    # resuming is part of the certificate: every checkpoint case saves the model and its optimizer
    # mid-run and trains on from a new model and optimizer that loaded them, in each format and mode
    modes = [("", {})] + ([("-v21", {"xla_fsdp_v2": True})] if "xla_fsdp_v2" in keys else [])
    _resume_cases(add, keys, modes, "llama", "llama", "checkpoint")
    if "cpu_ram_efficient_loading" in keys:
        add("llama-cpu_ram_efficient_loading", "llama", {"cpu_ram_efficient_loading": True}, family="checkpoint")
        if _shards_without_weights(backend):  # persistent buffers are read from the file too
            for model in ("llama", "mlp_buffers"):
                add(
                    f"{model}-empty_weights",
                    model,
                    {"cpu_ram_efficient_loading": True},
                    empty_weights=True,
                    family="checkpoint",
                )
    if "timeout" in keys:
        add("mlp-timeout", "mlp", {"timeout": 600}, family="timeout")
    if "use_cpu" in keys:  # on the CPU whatever the run certifies: the placement check holds it there
        add("llama-use_cpu", "llama", {"use_cpu": True}, family="device")

    # features every backend must get right, whatever keys it declares
    for model, pats in _FROZEN.items():
        add(f"frozen-{model}", model, {}, frozen=pats, family="frozen")
    add("buffers-mlp", "mlp_buffers", {}, family="buffers")
    add("uneven-mlp", "mlp_uneven", {}, family="uneven")
    if "auto_wrap_policy" in keys:
        add("uneven-mlp-nowrap", "mlp_uneven", {"auto_wrap_policy": "NO_WRAP"}, family="uneven")
    # units returning several grad-carrying tensors (LlamaAttention's shape), under each structural
    # knob the backend has: resharding or not, recomputation, and each XLA mode
    multi = [{}]
    for key, tag, default in toggles:
        if key in ("reshard_after_forward", "xla_fsdp_v2"):
            multi += [{**m, key: not default} for m in multi]
    ckpt = next((k for k in ("activation_checkpointing", "xla_fsdp_grad_ckpt") if k in keys), None)
    if ckpt:
        multi += [{**m, ckpt: True} for m in multi]
    for m in multi:
        tags = "".join(f"-{tag}{int(m[k])}" for k, tag, _ in _TOGGLES if k in m)
        add(f"multi_output-mlp{tags}", "mlp_two_outputs", m, family="multi_output")
    add("grad_accum-mlp", "mlp", {}, grad_accum=2, family="grad_accum")
    add("grad_accum-llama", "llama", {}, grad_accum=2, family="grad_accum")
    if "reshard_after_forward" in keys:
        add("grad_accum-llama-reshard0", "llama", {"reshard_after_forward": False}, grad_accum=2, family="grad_accum")
    if _clips(backend):
        _clipping_cases(add, keys)
    if {"dp_replicate_size", "dp_shard_size"} <= keys and world_size >= 2:
        _hsdp_cases(add, keys, world_size, _clips(backend))
    if {"tp_size", "tp_plan"} <= keys and world_size % 2 == 0:
        _tp_cases(add, backend, keys, world_size, _clips(backend))
    if "torch_compile" in keys:
        _compile_cases(add, keys, world_size, _clips(backend))
    if _peft_installed():
        _lora_cases(add, keys, _clips(backend), modes)
    add("lr_schedule-mlp", "mlp", {}, lr_schedule="warmup_cosine", family="lr_schedule")
    add("lr_schedule-gpt2", "gpt2", {}, lr_schedule="warmup_cosine", family="lr_schedule")

    knob = low_precision_knob(keys)
    if dtype == "fp32":
        return fp32
    if dtype == "bf16":
        if knob is None:
            raise ValueError(
                "--dtype bf16: the backend declares neither 'mixed_precision' nor 'xla_fsdp_settings' in its "
                f"supported_keys ({', '.join(sorted(keys)) or 'none'}), so it has no way to compute in bf16."
            )
        return [_low_precision(c, knob, f"{c.name}-bf16") for c in fp32]
    out = list(fp32)
    if "mixed_precision" in keys:
        for model in STRUCTURAL_MODELS:
            out.append(
                _low_precision(
                    Case(f"{model}-mp-bf16", model, dict(base), global_batch=gb), {"mixed_precision": "bf16"}
                )
            )
        out.append(
            _low_precision(
                Case("llama-mp-bf16-reduce-fp32", "llama", dict(base), global_batch=gb),
                {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
            )
        )
        out.append(
            _low_precision(
                Case("frozen-llama-mp-bf16", "llama", dict(base), global_batch=gb, frozen=_FROZEN["llama"]),
                {"mixed_precision": "bf16"},
            )
        )
        if "torch_compile" in keys:
            out.append(
                _low_precision(
                    Case(
                        "compile-llama-mp-bf16", "llama", {**base, **COMPILE_QUICK}, global_batch=gb, family="compile"
                    ),
                    {"mixed_precision": "bf16"},
                    "compile-llama-mp-bf16",
                )
            )
        # tensor parallelism in bf16: each rowwise layer's partial sums, and each column split's
        # input gradient, are rounded to bf16 on every tp rank before the all-reduce sums them
        tag = _tp_tag(world_size)
        for c in fp32:
            if c.name in (f"{tag}-llama", f"{tag}-qwen2", f"{tag}-clip-llama"):
                out.append(_low_precision(c, {"mixed_precision": "bf16"}, f"{c.name}-mp-bf16"))
    if knob is not None and _peft_installed():
        out.append(
            _low_precision(
                Case("lora-llama-bf16", "llama_lora", dict(base), global_batch=gb, family="lora"),
                knob,
                "lora-llama-bf16",
            )
        )
    if knob is not None and _clips(backend):
        out.append(
            _low_precision(
                Case("clip-llama-bf16", "llama", dict(base), global_batch=gb, max_grad_norm=CLIP_NORM),
                knob,
                "clip-llama-bf16",
            )
        )
    if "xla_fsdp_settings" in keys:
        for model in STRUCTURAL_MODELS:
            out.append(
                _low_precision(
                    Case(f"{model}-xla-bf16", model, dict(base), global_batch=gb),
                    {"xla_fsdp_settings": {"compute_dtype": "bfloat16"}},
                )
            )
    return out


def _resume_cases(
    add: Any, keys: frozenset[str], modes: list[tuple[str, dict[str, Any]]], prefix: str, model: str, family: str
) -> None:
    """Resuming is part of the certificate: in each mode, save the model and its optimizer mid-run in
    the FULL format and (with ``state_dict_type``) in the mode's own SHARDED format, and train on from a
    new model and optimizer that loaded them."""
    for tag, mode in modes:
        add(f"{prefix}-resume{tag}", model, mode, resume_at=RESUME_AT, family=family)
    if "state_dict_type" in keys:
        for tag, mode in modes:
            add(
                f"{prefix}-sharded_state_dict{tag}",
                model,
                {"state_dict_type": "SHARDED_STATE_DICT", **mode},
                resume_at=RESUME_AT,
                family=family,
            )
    if "async_save" in keys and prefix == "llama":  # written in the background, in each format
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")[: 1 + ("state_dict_type" in keys)]:
            name = f"{prefix}-async_save" + ("-sharded" if kind.startswith("SHARDED") else "")
            add(name, model, {"async_save": True, "state_dict_type": kind}, resume_at=RESUME_AT, family=family)


def _peft_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def _lora_cases(add: Any, keys: frozenset[str], clips: bool, modes: list[tuple[str, dict[str, Any]]]) -> None:
    """PEFT LoRA models (a frozen base with rank-4 adapters in the same units), on the Llama and on GPT-2
    (whose fused ``c_attn`` is a ``Conv1D``), in each XLA mode, under each structural knob the backend
    has, clipped, accumulated, and resumed from a SHARDED checkpoint. Every case's FULL checkpoint is
    the adapter directory, which PEFT's own ``PeftModel.from_pretrained`` must load to the reference's
    outputs, and its merged export must load with ``from_pretrained`` as a plain model."""
    for tag, mode in modes:
        add(f"lora-llama{tag}", "llama_lora", mode, family="lora")
    add("lora-gpt2", "gpt2_lora", {}, family="lora")
    if "reshard_after_forward" in keys:
        add("lora-llama-reshard0", "llama_lora", {"reshard_after_forward": False}, family="lora")
    ckpt = next((k for k in ("activation_checkpointing", "xla_fsdp_grad_ckpt") if k in keys), None)
    if ckpt:
        add("lora-llama-ac1", "llama_lora", {ckpt: True}, family="lora")
    if clips:
        add("lora-llama-clip", "llama_lora", {}, max_grad_norm=CLIP_NORM, family="lora")
    add("lora-llama-grad_accum", "llama_lora", {}, grad_accum=2, family="lora")
    if "xla_fsdp_v2" in keys:
        # a bf16 base with fp32 adapters trains under SPMD (FSDP2 and XLA FSDP refuse it by name: they
        # shard a unit, or every parameter, in one dtype); compared at bf16 tolerances
        add(
            "lora-llama-mixed_dtypes-v21",
            "llama_lora_mixed",
            {"xla_fsdp_v2": True},
            dtype="bf16",
            lr=LOW_PRECISION_LR,
            family="lora",
        )
    _resume_cases(add, keys, modes, "lora-llama", "llama_lora", "lora")


def _hsdp_cases(add: Any, keys: frozenset[str], world_size: int, clips: bool) -> None:
    """Hybrid sharding (accelerate's dp_replicate_size x dp_shard_size): 2 replicas of world/2
    shards where the world splits so (2x2 on 4 ranks), and pure replication (world x 1). Every rank,
    so every replica, trains on its own rows of the batch: a replica all-reduce that is missing or
    wrong leaves the replicas apart and the case fails. On XLA, HSDP is SPMD only (XLA FSDP's
    sharding_groups never all-reduce across groups), so the cases carry ``xla_fsdp_v2: true``, which
    has no ``reshard_after_forward: false``."""
    shapes = [(world_size, 1)]
    if world_size >= 4 and world_size % 2 == 0:
        shapes.insert(0, (2, world_size // 2))
    for r, sh in shapes:
        mesh = {"dp_replicate_size": r, "dp_shard_size": sh}
        if "xla_fsdp_v2" in keys:
            mesh["xla_fsdp_v2"] = True
        tag = f"hsdp{r}x{sh}"
        add(f"{tag}-mlp", "mlp", mesh, family="hsdp")
        add(f"{tag}-llama", "llama", mesh, family="hsdp")
        if r == 2:
            if "reshard_after_forward" in keys and "xla_fsdp_v2" not in mesh:
                add(f"{tag}-llama-reshard0", "llama", {**mesh, "reshard_after_forward": False}, family="hsdp")
            add(f"{tag}-grad_accum-llama", "llama", mesh, grad_accum=2, family="hsdp")
            if "state_dict_type" in keys:
                add(
                    f"{tag}-llama-sharded_state_dict",
                    "llama",
                    {**mesh, "state_dict_type": "SHARDED_STATE_DICT"},
                    resume_at=RESUME_AT,
                    family="hsdp",
                )
            if "async_save" in keys:  # the background gather of replicated shards to rank 0
                add(
                    f"{tag}-llama-async_save", "llama", {**mesh, "async_save": True}, resume_at=RESUME_AT, family="hsdp"
                )
            add(f"{tag}-gpt2", "gpt2", mesh, family="hsdp")
            if clips:  # the norm is over the shards of one replica, not over every rank
                add(f"{tag}-clip-llama", "llama", mesh, max_grad_norm=CLIP_NORM, family="hsdp")


#: an explicit tp_plan (the MLPs only, attention's output projection taking its input whole): the
#: key observed by the cases, and two styles the models' own plans do not use
TP_PLAN = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.self_attn.o_proj": "rowwise_split_input",
    "lm_head": "colwise_gather_output",
}


def _tp_tag(world_size: int) -> str:
    """The name prefix of the tp cases at ``world_size``: pure TP on 2 ranks, dp x tp 2 above."""
    return "tp2" if world_size == 2 else f"dp{world_size // 2}-tp2"


def _tp_cases(add: Any, backend: Any, keys: frozenset[str], world_size: int, clips: bool) -> None:
    """Tensor parallelism over pairs of ranks (``tp_size`` 2): pure TP on 2 ranks (``tp2-``), TP
    under FSDP on more (``dp2-tp2-`` on 4: dp_shard 2 x tp 2; ``hsdp2x1-tp2-``: 2 replicas x tp 2).
    On XLA the cases are SPMD's (``xla_fsdp_v2``). Llama (its own plan, GQA) and Qwen2 (its own
    plan, biased q/k/v, tied embeddings split along the vocabulary), each with the structural knobs, accumulation, clipping, resume in both
    checkpoint formats, and rank 0's weights or each rank's slices of a FULL checkpoint
    (``cpu_ram_efficient_loading``). Besides the numbers, the placement check holds every weight to the plan's
    split on the ``tp`` mesh dim and the communication check counts TP's collectives (FSDP's only
    in the compiled case, on 4 ranks: TP's run inside the compiled graphs). In bf16, a Llama whose
    weights are bf16 here (the mixed-precision cases are added with the other bf16 one-offs)."""
    dp = world_size // 2
    tag = _tp_tag(world_size)
    # on XLA, SPMD is the mode with a tensor axis (XLA FSDP refuses tp_size)
    tp = {"tp_size": 2, **({"xla_fsdp_v2": True} if "xla_fsdp_v2" in keys else {})}
    add(f"{tag}-llama", "llama_tp", tp, family="tp")
    add(f"{tag}-qwen2", "qwen2_tp", tp, family="tp")
    add(f"{tag}-llama-plan", "llama_tp", {**tp, "tp_plan": TP_PLAN}, family="tp")
    for ckpt in ("activation_checkpointing", "xla_fsdp_grad_ckpt"):
        if ckpt in keys:
            add(f"{tag}-llama-{'ac1' if ckpt[0] == 'a' else 'gc1'}", "llama_tp", {**tp, ckpt: True}, family="tp")
    if "reshard_after_forward" in keys:
        add(f"{tag}-llama-reshard0", "llama_tp", {**tp, "reshard_after_forward": False}, family="tp")
    add(f"{tag}-grad_accum-llama", "llama_tp", tp, grad_accum=2, family="tp")
    if clips:
        add(f"{tag}-clip-llama", "llama_tp", tp, max_grad_norm=CLIP_NORM, family="tp")
        add(f"{tag}-clip-qwen2-inf", "qwen2_tp", tp, max_grad_norm=CLIP_NORM, norm_type=math.inf, family="tp")
    add(f"{tag}-llama-resume", "llama_tp", tp, resume_at=RESUME_AT, family="tp")
    add(f"{tag}-llama-bf16_weights", "llama_tp_bf16", tp, dtype="bf16", lr=LOW_PRECISION_LR, family="tp")
    if "state_dict_type" in keys:
        sharded = {**tp, "state_dict_type": "SHARDED_STATE_DICT"}
        add(f"{tag}-llama-sharded_state_dict", "llama_tp", sharded, resume_at=RESUME_AT, family="tp")
        add(f"{tag}-qwen2-sharded_state_dict", "qwen2_tp", sharded, resume_at=RESUME_AT, family="tp")
    if "cpu_ram_efficient_loading" in keys:  # rank 0's weights, or each rank's slices of a FULL checkpoint
        efficient = {**tp, "cpu_ram_efficient_loading": True}
        add(f"{tag}-llama-cpu_ram_efficient_loading", "llama_tp", efficient, family="tp")
        if _shards_without_weights(backend):
            add(f"{tag}-llama-empty_weights", "llama_tp", efficient, empty_weights=True, family="tp")
    if {"dp_replicate_size", "dp_shard_size"} <= keys and dp >= 2:
        add(f"hsdp{dp}x1-tp2-llama", "llama_tp", {**tp, "dp_replicate_size": dp}, family="tp")
    if "torch_compile" in keys and dp >= 2:  # on 2 ranks nothing would count: TP's collectives are compiled
        add(f"{tag}-compile-llama", "llama_tp", {**tp, **COMPILE_QUICK}, family="tp")


#: the compile cases that cross ``torch_compile`` with another knob use the ``aot_eager`` backend:
#: dynamo's capture and AOT autograd's joint graph around the sharding hooks, where the interplay
#: with sharding lives, without inductor's C++ code generation (tens of seconds per graph on a
#: small CPU); inductor, the default, runs in the cases without a backend key
COMPILE_QUICK = {"torch_compile": True, "torch_compile_backend": "aot_eager"}


def _compile_cases(add: Any, keys: frozenset[str], world_size: int, clips: bool) -> None:
    """``torch_compile``: units compiled in place before sharding, with the default backend
    (inductor) on Llama and GPT-2 and under activation checkpointing, and with :data:`COMPILE_QUICK`
    under every other knob the backend has. The suite also checks that the units were compiled in
    the first step and never again (no recompilation), and each step's collectives."""
    on = {"torch_compile": True}
    for model in ("llama", "gpt2"):
        add(f"compile-{model}", model, on, family="compile")
    if "activation_checkpointing" in keys:
        add("compile-llama-ac1", "llama", {**on, "activation_checkpointing": True}, family="compile")
    if "torch_compile_mode" in keys:
        add("compile-llama-mode", "llama", {**on, "torch_compile_mode": "default"}, family="compile")
    quick = [
        ("reshard_after_forward", "reshard0", {"reshard_after_forward": False}),
        ("torch_compile_fullgraph", "fullgraph", {"torch_compile_fullgraph": True}),
        # (dynamic: true traces symbolic shapes through the Hugging Face code: 40 s here, a case alone)
        ("torch_compile_dynamic", "static", {"torch_compile_dynamic": False}),
        ("torch_compile_regional", "whole", {"torch_compile_regional": False}),
        ("cpu_offload", "cpu_offload", {"cpu_offload": True}),
        ("state_dict_type", "sharded_state_dict", {"state_dict_type": "SHARDED_STATE_DICT"}),
    ]
    for key, tag, cfg in quick:
        if key in keys:
            resume = RESUME_AT if key == "state_dict_type" else 0
            add(f"compile-llama-{tag}", "llama", {**COMPILE_QUICK, **cfg}, resume_at=resume, family="compile")
    if "auto_wrap_policy" in keys:  # no unit but the root: the root is compiled
        add("compile-mlp-nowrap", "mlp", {**COMPILE_QUICK, "auto_wrap_policy": "NO_WRAP"}, family="compile")
    add("compile-grad_accum-llama", "llama", COMPILE_QUICK, grad_accum=2, family="compile")
    if clips:
        add("compile-clip-llama", "llama", COMPILE_QUICK, max_grad_norm=CLIP_NORM, family="compile")
    if {"dp_replicate_size", "dp_shard_size"} <= keys and world_size >= 2:
        r = 2
        add(
            f"hsdp{r}x{world_size // r}-compile-llama",
            "llama",
            {**COMPILE_QUICK, "dp_replicate_size": r, "dp_shard_size": world_size // r},
            family="compile",
        )


def _clips(backend: Any) -> bool:
    """Whether the backend declares gradient clipping (shardcore.capabilities.GradClipping)."""
    from shardcore.capabilities import GradClipping

    return isinstance(_instance(backend), GradClipping)


def _shards_without_weights(backend: Any) -> bool:
    """Whether the backend shards models built without weights (SlicedLoading) in its default mode."""
    import shardcore
    from shardcore.capabilities import SlicedLoading

    found = _instance(backend)
    return isinstance(found, SlicedLoading) and found.shards_without_weights(shardcore.parse_config({}))


def _instance(backend: Any) -> Any:
    """The implementation whose capabilities the matrix asks about: for a name resolved by the config
    (ConfigResolved), the one its default config picks (its implementations declare the same)."""
    import shardcore
    from shardcore.backend import for_config

    found = shardcore.get_backend(backend) if isinstance(backend, str) else backend
    return for_config(found, shardcore.parse_config({}))


#: small enough that every clipping case clips at every step (the models' gradient norms are larger)
CLIP_NORM = 0.05


def _clipping_cases(add: Any, keys: frozenset[str]) -> None:
    """Clipping by the norm of the whole gradient, on every model, under each structural knob the
    backend has, with the infinity norm, frozen and unused parameters, and accumulation."""
    for model in ("mlp", "llama", "gpt2"):
        add(f"clip-{model}", model, {}, max_grad_norm=CLIP_NORM, family="clipping")
    add("clip-llama-inf", "llama", {}, max_grad_norm=CLIP_NORM / 10, norm_type=float("inf"), family="clipping")
    for key, tag, default in _TOGGLES:
        if key in keys:
            add(
                f"clip-llama-{tag}{int(not default)}",
                "llama",
                {key: not default},
                max_grad_norm=CLIP_NORM,
                family="clipping",
            )
    if "auto_wrap_policy" in keys:
        add("clip-llama-nowrap", "llama", {"auto_wrap_policy": "NO_WRAP"}, max_grad_norm=CLIP_NORM, family="clipping")
    add("clip-frozen-llama", "llama", {}, frozen=_FROZEN["llama"], max_grad_norm=CLIP_NORM, family="clipping")
    add("clip-unused-mlp", "mlp_unused", {}, max_grad_norm=CLIP_NORM, family="clipping")
    add("clip-grad_accum-llama", "llama", {}, grad_accum=2, max_grad_norm=CLIP_NORM, family="clipping")
    if "cpu_offload" in keys:
        add("clip-llama-cpu_offload", "llama", {"cpu_offload": True}, max_grad_norm=CLIP_NORM, family="clipping")


def _low_precision(case: Case, knob: dict[str, Any], name: str | None = None) -> Case:
    """``case`` computing in bf16 through ``knob``; a bf16 one-off (no ``name``) is in the family
    of its knob, a case of the all-bf16 matrix stays in its own family."""
    family = case.family if name else ("mixed_precision" if "mixed_precision" in knob else "xla_compute_dtype")
    return replace(
        case, name=name or case.name, config={**case.config, **knob}, dtype="bf16", lr=LOW_PRECISION_LR, family=family
    )


def fsdp2_matrix(world_size: int = 2) -> list[Case]:
    """The FSDP2 backend's matrix (see :func:`matrix_for`)."""
    return matrix_for("fsdp2", world_size)


def covered_keys(cases: list[Case]) -> dict[str, list[str]]:
    """Config key -> names of the cases that set it to a non-default value."""
    from shardcore import parse_config

    out: dict[str, list[str]] = {}
    for c in cases:
        for k in parse_config(c.config).non_default_keys():
            out.setdefault(k, []).append(c.name)
    return out


def select(cases: list[Case], pattern: str | None) -> list[Case]:
    """Cases whose name matches any of the comma-separated glob patterns in ``pattern``."""
    if not pattern:
        return cases
    pats = [p.strip() for p in pattern.split(",") if p.strip()]
    return [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in pats)]
