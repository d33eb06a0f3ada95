"""``ckpt_efficient.py DIR`` (2 ranks): from_pretrained with cpu_ram_efficient_loading of
``hf_single`` and ``full3``: only rank 0 reads the file; every rank writes its shards' and buffers'
differences from the file, what stayed on meta, its logits and whether the weights are still tied."""

import sys
from pathlib import Path

import torch

import shardcore
import shardcore.checkpoint as ckpt

from ckpt_common import build, file_tensors, logits, run, write_rank


def efficient(d: Path) -> None:
    """cpu_ram_efficient_loading: only rank 0 reads the file; check every rank's shards and buffers."""
    from transformers import AutoModelForCausalLM

    for name in ("hf_single", "full3"):
        cfg = {"cpu_ram_efficient_loading": True}
        model = shardcore.from_pretrained(AutoModelForCausalLM, d / name, cfg)
        ref = file_tensors(d / name)
        on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        diffs = {}
        for n, p in model.state_dict().items():
            src = ref.get(n, ref.get(ckpt.tied_names(model).get(n, "")))
            local = p.to_local() if hasattr(p, "to_local") else p
            expect = _local_part(src, p) if hasattr(p, "to_local") else src
            diffs[n] = float((local.float() - expect.float()).abs().max()) if local.numel() else 0.0
        plain = build()  # the rotary buffers a model computes itself
        buffers = {n: float((b - dict(plain.named_buffers())[n]).abs().max()) for n, b in model.named_buffers()}
        write_rank(
            d,
            f"efficient_{name}",
            {
                "on_meta": on_meta,
                "max_param_diff": max(diffs.values()),
                "n": len(diffs),
                "max_buffer_diff": max(buffers.values()),
                "buffers": sorted(buffers),
                "logits": logits(model).tolist(),
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            },
        )
        del model


def _local_part(full_tensor: torch.Tensor, dt) -> torch.Tensor:
    """This rank's piece of ``full_tensor`` under ``dt``'s placements, computed without comms."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    idx = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full_tensor[idx]


if __name__ == "__main__":
    run(efficient, Path(sys.argv[1]))
