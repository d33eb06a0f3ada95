"""Small deterministic models and data for the conformance cases.

Sizes are deliberately odd (13, 33, ...) so that parameter dim-0 sizes do not divide the world
size and the uneven last shard is exercised.
"""
from __future__ import annotations

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


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def build_llama(**overrides) -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**overrides))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "llama": build_llama,
}


def build_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_batches(name: str, steps: int, global_batch: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1000)
    out = []
    for _ in range(steps):
        if name == "mlp":
            out.append({"x": torch.randn(global_batch, 13, generator=g), "y": torch.randn(global_batch, 5, generator=g)})
        else:
            ids = torch.randint(0, 97, (global_batch, 16), generator=g)
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def loss_fn(name: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if name == "mlp":
        out = model(batch["x"])
        return F.mse_loss(out.float(), batch["y"].to(out.device).float())
    return model(**batch).loss.float()
