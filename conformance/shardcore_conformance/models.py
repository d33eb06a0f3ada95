"""Small deterministic models and data for the conformance cases.

Sizes are deliberately odd (13, 33, 97, ...) so that parameter dim-0 sizes do not divide the world
size and the uneven last shard is exercised; ``mlp_uneven`` goes further, with a head of one output
whose weight and bias have a single row, so every rank but the first holds an empty shard.

Every model is built from a seed on the CPU; the Hugging Face models are built from configs (no
download), with dropout off so that the sharded run and the reference see the same function.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.fc(x)))


class MLP(nn.Module):
    """Three blocks and a head; ``_no_split_modules`` lets TRANSFORMER_BASED_WRAP find the blocks
    the way it finds a Hugging Face model's decoder layers."""

    _no_split_modules = ["MLPBlock"]

    def __init__(self, d_in: int = 13, hidden: int = 33, d_out: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(d_in, hidden), MLPBlock(hidden, hidden), MLPBlock(hidden, hidden)])
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class UnusedParamMLP(MLP):
    """An MLP with a trainable head it never calls: its parameters get no gradient (``grad`` stays
    None), which clipping and the optimizer must skip on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(33, 5)


class ScaledBlock(MLPBlock):
    """An MLP block with a persistent buffer (a fixed per-feature scale) and a non-persistent one
    (a shift), both inside a sharding unit: buffers are not sharded but must be moved, kept and
    checkpointed (the persistent one) like the parameters around them."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_out))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, d_out), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x))
        # in the activations' dtype, as Hugging Face models use their buffers (mixed precision keeps
        # buffers in fp32 while activations are bf16)
        return F.gelu(h * self.scale.to(h.dtype) + self.shift.to(h.dtype))


class BufferMLP(nn.Module):
    """Buffers of three kinds: fixed float buffers inside units (:class:`ScaledBlock`) and an int64
    counter in the root that every forward increments, so the final state dict records how many
    forwards ran (activation checkpointing must not recompute the root)."""

    _no_split_modules = ["ScaledBlock"]

    def __init__(self, d_in: int = 13, hidden: int = 33, d_out: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList([ScaledBlock(d_in, hidden), ScaledBlock(hidden, hidden)])
        self.head = nn.Linear(hidden, d_out)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class TwoOutputBlock(nn.Module):
    """A unit shaped like ``LlamaAttention``: it returns ``(out, w)`` where ``w`` (the attention
    weights) is an autograd ancestor of ``out``, and the caller uses only ``out``. Hooks that a
    sharding wrapper puts on every output then fire twice in backward."""

    def __init__(self, d: int):
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.softmax(self.a(x), dim=-1)
        return self.b(w), w


class TwoOutputMLP(nn.Module):
    _no_split_modules = ["TwoOutputBlock"]

    def __init__(self, d_in: int = 13, hidden: int = 33, d_out: int = 5):
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList([TwoOutputBlock(hidden), TwoOutputBlock(hidden)])
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            out, _ = b(h)
            h = h + out
        return self.head(h)


# Tiny Hugging Face models: (config class, model class, config) in transformers. Llama: GQA, RMSNorm,
# rotary positions (a non-persistent buffer), untied head. GPT-2: tied input and output embeddings
# (``lm_head.weight is transformer.wte.weight``), learned positions, fused QKV ``Conv1D``; dropout off.
#: the Llama-shaped decoders' sizes (Llama, Qwen2)
_DECODER = dict(
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)
_TINY_HF = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=97, tie_word_embeddings=False, **_DECODER)),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=97,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=True,
            attn_implementation="eager",
        ),
    ),
    # a second architecture with its own tensor-parallel plan: tied input and output embeddings, both
    # split along the vocabulary, and biased q/k/v projections (a colwise bias is split too)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(vocab_size=96, tie_word_embeddings=True, **_DECODER)),
}


def _tiny_config(arch: str, overrides: dict):
    import transformers

    config_cls, _, kw = _TINY_HF[arch]
    return getattr(transformers, config_cls)(**{**kw, **overrides})


def _tiny_model(arch: str, overrides: dict) -> nn.Module:
    import transformers

    return getattr(transformers, _TINY_HF[arch][1])(_tiny_config(arch, overrides))


def tiny_llama_config(**overrides):
    return _tiny_config("llama", overrides)


def build_llama(**overrides) -> nn.Module:
    return _tiny_model("llama", overrides)


def tiny_gpt2_config(**overrides):
    return _tiny_config("gpt2", overrides)


def build_gpt2(**overrides) -> nn.Module:
    return _tiny_model("gpt2", overrides)


#: the LoRA cases' adapters: the attention projections of each architecture (GPT-2's fused c_attn is a
#: Conv1D, whose weight PEFT reads transposed)
LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def build_lora(arch: str) -> nn.Module:
    """A tiny model wrapped by PEFT with a rank-4 LoRA adapter (``get_peft_model``): the base frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS[arch], task_type="CAUSAL_LM")
    return get_peft_model(_tiny_model(arch, {}), config)


def build_lora_mixed(arch: str) -> nn.Module:
    """PEFT's usual set-up: a bf16 base whose adapters PEFT keeps in fp32 (``autocast_adapter_dtype``)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS[arch], task_type="CAUSAL_LM")
    return get_peft_model(_tiny_model(arch, {}).to(torch.bfloat16), config)


def lora_base(arch: str) -> nn.Module:
    """The base model of :func:`build_lora` alone, as PEFT's ``from_pretrained`` gets it."""
    return _tiny_model(arch, {})


@dataclass(frozen=True)
class ModelSpec:
    """How to build one conformance model and feed it.

    ``kind`` is ``"regression"`` (batches ``{"x", "y"}``, MSE loss) or ``"causal_lm"`` (batches
    ``{"input_ids", "labels"}``, the model's own loss). ``layer_cls`` is the class that
    TRANSFORMER_BASED_WRAP finds through ``_no_split_modules``; ``size_wrap_min_params`` is a
    ``min_num_params`` that gives SIZE_BASED_WRAP a few units, or None where no threshold is valid
    (tied embeddings: any unit that takes the input embedding shares it with the head outside).
    """

    build: Callable[[], nn.Module]
    kind: str
    d_in: int = 13
    d_out: int = 5
    vocab: int = 97
    seq_len: int = 16
    size_wrap_min_params: int | None = 500
    tied: bool = False


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(MLP, "regression"),
    "mlp_uneven": ModelSpec(lambda: MLP(d_in=7, hidden=11, d_out=1), "regression", d_in=7, d_out=1),
    "mlp_buffers": ModelSpec(BufferMLP, "regression"),
    "mlp_two_outputs": ModelSpec(TwoOutputMLP, "regression"),
    "mlp_unused": ModelSpec(UnusedParamMLP, "regression"),
    "llama": ModelSpec(build_llama, "causal_lm", size_wrap_min_params=2000),
    "gpt2": ModelSpec(build_gpt2, "causal_lm", size_wrap_min_params=None, tied=True),
    # tensor parallelism splits the vocabulary: 96 rows divide among 2 and 4 ranks, 97 do not
    "llama_tp": ModelSpec(lambda: build_llama(vocab_size=96), "causal_lm", size_wrap_min_params=2000, vocab=96),
    # the whole model in bf16: parameters, gradients and AdamW state (SPMD has no mixed-precision key)
    "llama_tp_bf16": ModelSpec(
        lambda: build_llama(vocab_size=96).to(torch.bfloat16), "causal_lm", size_wrap_min_params=2000, vocab=96
    ),
    "qwen2_tp": ModelSpec(
        lambda: _tiny_model("qwen2", {}), "causal_lm", size_wrap_min_params=None, tied=True, vocab=96
    ),
    "llama_lora": ModelSpec(lambda: build_lora("llama"), "causal_lm", size_wrap_min_params=2000),
    "gpt2_lora": ModelSpec(lambda: build_lora("gpt2"), "causal_lm", size_wrap_min_params=None, tied=True),
    "llama_lora_mixed": ModelSpec(lambda: build_lora_mixed("llama"), "causal_lm", size_wrap_min_params=2000),
}


def is_lora(name: str) -> bool:
    return "_lora" in name


def lora_base_of(name: str) -> nn.Module:
    """The base model a LoRA model ``name`` wraps, built as it builds it (same draws, same dtype)."""
    arch = name.split("_lora")[0]
    base = lora_base(arch)
    return base.to(torch.bfloat16) if name.endswith("_mixed") else base


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"no conformance model named {name!r}; known: {', '.join(MODELS)}") from None


# Device threads of one process (xmp.spawn on CPU PJRT) share torch's global generator, so a build
# that seeds it races with every other thread that draws from it (not only with other builds), and
# ranks start from different weights. The harness therefore builds each (model, seed) once, in a
# thread of its own before any device thread starts (initial_states), hands the weights to the
# device process (preload), and every build_model there loads them.
_BUILD_LOCK = threading.Lock()
_INITIAL: dict[tuple[str, int], dict[str, torch.Tensor]] = {}


def initial_states(keys) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """The initial weights of each (model name, seed) in ``keys``. Call it while no other thread of
    the process draws random numbers."""
    out = {}
    for name, seed in keys:
        torch.manual_seed(seed)
        out[(name, seed)] = {k: v.detach().clone() for k, v in spec(name).build().state_dict().items()}
    return out


def preload(states: dict[tuple[str, int], dict[str, torch.Tensor]]) -> None:
    with _BUILD_LOCK:
        _INITIAL.update(states)


def build_model(name: str, seed: int) -> nn.Module:
    """``name`` with the weights seed ``seed`` gives: the preloaded ones where the harness preloaded
    them, else built here (a single thread, or one process per rank)."""
    # under the lock also because Transformers' lazy module loading is not thread-safe (two device
    # threads reaching transformers.LlamaForCausalLM first at once: one gets an AttributeError)
    with _BUILD_LOCK:
        state = _INITIAL.get((name, seed))
        if state is None:
            torch.manual_seed(seed)
        model = spec(name).build()
    if state is not None:
        model.load_state_dict(state)
    return model


def make_batches(name: str, steps: int, global_batch: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches of ``global_batch`` rows, the same on every rank and in the reference."""
    s = spec(name)
    g = torch.Generator().manual_seed(seed + 1000)
    out = []
    for _ in range(steps):
        if s.kind == "regression":
            out.append(
                {
                    "x": torch.randn(global_batch, s.d_in, generator=g),
                    "y": torch.randn(global_batch, s.d_out, generator=g),
                }
            )
        else:
            ids = torch.randint(0, s.vocab, (global_batch, s.seq_len), generator=g)
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def probe_batch(name: str, rows: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fixed batch, disjoint from the training stream, on which a checkpoint's logits are compared."""
    return make_batches(name, 1, rows, seed + 7919)[0]


def forward_output(name: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's raw output (regression values or LM logits) as float, for checkpoint comparisons."""
    if spec(name).kind == "regression":
        return model(batch["x"]).float()
    return model(input_ids=batch["input_ids"]).logits.float()


def loss_fn(name: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if spec(name).kind == "regression":
        out = model(batch["x"])
        return F.mse_loss(out.float(), batch["y"].to(out.device).float())
    return model(**batch).loss.float()


def llama_lora() -> nn.Module:
    """A ``module:factory`` for ``shardcore plan --model``: the LoRA cases' Llama."""
    return build_lora("llama")
