"""``ckpt_sliced.py DIR`` (2 or 4 ranks): sliced reading of the FULL checkpoints in DIR against the
rank-0 path; every rank writes DIR/sliced<world>.rank<r>.json."""

import os
import sys
from pathlib import Path

import torch

import shardcore
import shardcore.checkpoint as ckpt

from ckpt_common import backend, build, expect_error, logits, rank, run, sharded, write_rank


def local_shards(model) -> dict[str, torch.Tensor]:
    """This rank's part of every state-dict tensor, as it sits in memory."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in model.state_dict().items()}


def _rank0_path(model, src: Path, opt=None) -> None:
    """What shardcore.load did before sliced loading: rank 0 reads every file, the backend spreads it."""
    files = ckpt.full.weight_files(src)
    state = ckpt.full.read_weights(files, ckpt.tied_names(model)) if rank() == 0 else {}
    backend(model).load_full_state_dict(model, state)
    if opt is not None:
        osd = ckpt.full.read_optimizer(*ckpt.full.optimizer_files(src, opt)) if rank() == 0 else {}
        backend(model).load_full_optimizer_state_dict(model, opt, osd)


def _optimizer_differs(model, opt, want_model, want_opt) -> list[str]:
    """Names of this rank's optimizer state entries (its rows) that differ from ``want_opt``'s."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    want_params = dict(want_model.named_parameters())
    out = []
    for name, p in model.named_parameters():
        got, want = opt.state.get(p, {}), want_opt.state.get(want_params[name], {})
        if sorted(got) != sorted(want):
            out.append(f"{name}: keys {sorted(got)} != {sorted(want)}")
        out += [f"{name}.{k}" for k in got if k in want and not torch.equal(local(got[k]), local(want[k]))]
    return out


def _rank0_pretrained(src: Path, mesh: dict):
    """from_pretrained with cpu_ram_efficient_loading as it was before sliced loading: rank 0 reads
    the weights, the others build on meta, and shard() broadcasts rank 0's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(src)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    return shardcore.shard(model, {"cpu_ram_efficient_loading": True, **mesh}).eval()


def sliced(d: Path) -> None:
    """Sliced reading of FULL checkpoints (a shardcore one, save_pretrained's single file, and an
    index of shards), under every mesh this world allows: shardcore.load and from_pretrained with
    cpu_ram_efficient_loading give the shards the rank-0 path gives, bit for bit, and read no more
    than this rank keeps, never a whole file."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    def whole_file_read(*a, **k):
        raise AssertionError("a whole safetensors file was read on the sliced path")

    read = {"elements": 0}
    fill = ckpt.full.SliceReader.fill

    def counting_fill(self, name, index, out):
        read["elements"] += out.numel()
        return fill(self, name, index, out)

    ckpt.full.SliceReader.fill = counting_fill
    world = int(os.environ["WORLD_SIZE"])
    meshes = [{}] + ([{"dp_replicate_size": 2, "dp_shard_size": world // 2}] if world >= 4 else [])
    out = {}
    for mesh in meshes:
        tag = "x".join(str(v) for v in mesh.values()) or f"1x{world}"
        for name in ("full3", "hf_single", "hf_index"):
            src = d / name
            want_model, want_opt = sharded(seed=50, config=mesh)
            _rank0_path(want_model, src, want_opt if name == "full3" else None)
            want = local_shards(want_model)
            want_pre = _rank0_pretrained(src, mesh)
            want_logits = logits(want_pre)
            real_load_file, safetensors.torch.load_file = safetensors.torch.load_file, whole_file_read
            try:
                read["elements"] = 0
                loaded, opt = sharded(seed=51, config=mesh)
                shardcore.load(loaded, src, opt if name == "full3" else None)
                load_read = read["elements"]
                read["elements"] = 0
                efficient = {"cpu_ram_efficient_loading": True, **mesh}
                pre = shardcore.from_pretrained(AutoModelForCausalLM, src, efficient)
                pre_read = read["elements"]
            finally:
                safetensors.torch.load_file = real_load_file
            params = set(dict(pre.named_parameters()))
            plain = build()
            out[f"{tag}-{name}"] = {
                "load_differs": [k for k, v in local_shards(loaded).items() if not torch.equal(v, want[k])],
                "optimizer_differs": _optimizer_differs(loaded, opt, want_model, want_opt),
                "optimizer_entries": sum(len(st) for st in opt.state.values()),
                "n_params": len(list(loaded.parameters())),
                "pretrained_differs": [
                    k for k, v in local_shards(pre).items() if not torch.equal(v, local_shards(want_pre)[k])
                ],
                "same_keys": sorted(local_shards(pre)) == sorted(want),
                "logits_equal": torch.equal(logits(pre), want_logits),
                "buffers_equal": all(torch.equal(b, dict(plain.named_buffers())[n]) for n, b in pre.named_buffers()),
                "on_meta": [n for n, t in [*pre.named_parameters(), *pre.named_buffers()] if t.is_meta],
                "tied": pre.lm_head.weight is pre.model.embed_tokens.weight,
                "eval": not pre.training,
                "read": [load_read, pre_read],
                "local_params": sum(t.numel() for k, t in local_shards(pre).items() if k in params),
                "whole_params": sum(p.numel() for p in plain.parameters()),
            }
            del want_model, want_pre, loaded, pre
    # an empty model refuses a forward until it is loaded
    with shardcore.init_empty_weights():
        empty = build()
    empty = shardcore.shard(empty, {"cpu_ram_efficient_loading": True})
    refused = expect_error(lambda: logits(empty), "shardcore.load(model, path)", "uninitialized")
    shardcore.load(empty, d / "hf_single")
    out["guard"] = {"refused": refused, "after_load": logits(empty).tolist() is not None}
    write_rank(d, f"sliced{world}", out)


if __name__ == "__main__":
    run(sliced, Path(sys.argv[1]))
