"""Worker for tests/test_checkpoint.py, run by torchrun: ``ckpt.py SCENARIO DIR``.

Every rank runs the scenario; rank 0 writes what the test checks into DIR (per-rank checks go to
``DIR/<name>.rank<r>.json``). The model is the conformance suite's tiny Llama with tied embeddings,
trained with AdamW on the conformance batches, so every run sees the same numbers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardcore
import shardcore.checkpoint as ckpt
from shardcore_conformance.models import loss_fn, make_batches, tiny_llama_config

STEPS = 6
BATCH = 8
LR = 1e-2


def build(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True, **overrides))


def sharded(seed: int = 0, config: dict | None = None, **overrides):
    model = shardcore.shard(build(seed, **overrides), config or {})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, opt


def backend(model):
    return shardcore.handle(model).backend


def train(model, opt, first: int, last: int) -> list[float]:
    """Steps ``first``..``last - 1`` of the fixed schedule; the global mean loss of each."""
    rt = backend(model)
    losses = []
    for batch in make_batches("llama", STEPS, BATCH, 0)[first:last]:
        loss = loss_fn("llama", model, rt.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(rt.all_reduce_sum(loss.detach()) / rt.world().size))
    return losses


def full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend(model).full_state_dict(model).items()}


def probe() -> torch.Tensor:
    return torch.arange(24).reshape(2, 12) % 97


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe()).logits.detach().cpu()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def expect_error(fn, *needles: str) -> str:
    try:
        fn()
    except shardcore.CheckpointError as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        if missing:
            raise AssertionError(f"error message lacks {missing}: {msg}") from e
        return msg
    raise AssertionError("no CheckpointError was raised")


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def max_diff_to(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest |difference| over ``ref``'s keys (tied names missing from ``ref`` are skipped)."""
    assert set(ref) <= set(state), sorted(set(ref) - set(state))
    return max(float((state[k].float() - ref[k].float()).abs().max()) for k in ref)


def write(d: Path, name: str, obj) -> None:
    if rank() == 0:
        torch.save(obj, d / name)


def write_rank(d: Path, name: str, obj) -> None:
    (d / f"{name}.rank{rank()}.json").write_text(json.dumps(obj))


def hang_before_commit() -> None:
    """Kill-test hook: after the data of a save is written, announce it and wait to be killed."""
    real = ckpt.manifest.write_manifest

    def slow(tmp, manifest):
        marker = os.environ["CKPT_MARKER"]
        Path(marker).write_text(str(tmp))
        time.sleep(600)
        real(tmp, manifest)

    ckpt.manifest.write_manifest = slow


# ------------------------------------------------------------------------------------ scenarios


def train_save(d: Path) -> None:
    """3 steps, save FULL and SHARDED (with optimizer), 3 more steps: the straight 6-step run."""
    model, opt = sharded()
    losses = train(model, opt, 0, 3)
    shardcore.save(model, d / "full3", opt)  # the config's default: FULL_STATE_DICT
    shardcore.save(model, d / "sharded3", opt, state_dict_type="SHARDED_STATE_DICT")
    write(d, "step3.pt", {"logits": logits(model), "state": full(model)})
    losses += train(model, opt, 3, 6)
    write(d, "straight.pt", {"losses": losses, "state": full(model)})

    # a checkpoint of another model: every rank raises the same clear error, nobody hangs
    other, _ = sharded(hidden_size=48, intermediate_size=56)
    expect_error(lambda: shardcore.load(other, d / "full3"), "another model", "shape", "model.embed_tokens.weight")
    expect_error(lambda: shardcore.load(other, d / "sharded3"), "another model", "shape")
    deeper, _ = sharded(num_hidden_layers=3)
    expect_error(lambda: shardcore.load(deeper, d / "full3"), "missing", "model.layers.2.")
    expect_error(lambda: shardcore.load(deeper, d / "sharded3"), "missing", "model.layers.2.")
    shallower, _ = sharded(num_hidden_layers=1)
    expect_error(lambda: shardcore.load(shallower, d / "full3"), "unexpected", "model.layers.1.")
    expect_error(lambda: shardcore.load(model, d / "step3.pt"), "not a checkpoint")
    write(d, "errors.ok", True)


def world1(d: Path) -> None:
    """World size 1: load the 2-rank SHARDED checkpoint (2 -> 1) and save SHARDED again (for 1 -> 2)."""
    model, opt = sharded(seed=5)
    shardcore.load(model, d / "sharded3", opt)
    got = full(model)
    shardcore.save(model, d / "sharded_w1", opt, state_dict_type="SHARDED_STATE_DICT")
    write(d, "world1.pt", {"state": got})


def world1_killed(d: Path) -> None:
    """After the kill test: the SHARDED checkpoint whose replacement was killed still loads."""
    model, opt = sharded(seed=6)
    shardcore.load(model, d / "killed_sharded", opt)
    write(d, "killed_sharded.loaded.pt", full(model))


def resume(d: Path) -> None:
    """New processes: resume from each format and train the last 3 steps; 1 -> 2 reshard; loading
    single-device checkpoints."""
    out = {}
    for name in ("full3", "sharded3"):
        model, opt = sharded(seed=123)  # other initial weights: only the checkpoint can make them equal
        shardcore.load(model, d / name, opt)
        losses = train(model, opt, 3, 6)
        out[name] = {"losses": losses, "state": full(model)}
        del model, opt

    model, opt = sharded(seed=9)
    shardcore.load(model, d / "sharded_w1", opt)
    out["sharded_w1"] = full(model)

    for name in ("single", "hf_single"):  # saved on one device by plain PyTorch / save_pretrained
        model, _ = sharded(seed=11)
        shardcore.load(model, d / name)
        out[name] = full(model)

    write(d, "resume.pt", out)


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


def kill(d: Path, kind: str) -> None:
    """Save a checkpoint, train on, start saving again and hang there until the test kills us."""
    model, opt = sharded()
    train(model, opt, 0, 1)
    target = d / f"killed_{'full' if kind == 'FULL_STATE_DICT' else 'sharded'}"
    shardcore.save(model, target, opt, state_dict_type=kind)
    write(d, f"{target.name}.expected.pt", full(model))
    train(model, opt, 1, 2)
    hang_before_commit()
    shardcore.save(model, target, opt, state_dict_type=kind)
    raise SystemExit("the save returned, but the test hook should have hung it")


#: HSDP layouts (dp_replicate_size, dp_shard_size) a 4-rank run passes through, resuming each time
HSDP_CHAIN = ((2, 2), (1, 4), (4, 1))


def optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    osd = backend(model).full_optimizer_state_dict(model, opt)
    # rank 0 holds the gathered state (cpu_offload); the others get an empty dict
    return {f"{p}.{k}": torch.as_tensor(v).clone() for p, st in osd.get("state", {}).items() for k, v in st.items()}


def hsdp_chain(d: Path) -> None:
    """4 ranks: 2 steps in each layout of HSDP_CHAIN, each layout resuming the previous one's
    checkpoint (FULL, then SHARDED): what each load gives back, and the losses, against a straight
    6-step run at 1 x 4."""
    straight_model, straight_opt = sharded(seed=0, config={"dp_shard_size": 4})
    out = {"straight": train(straight_model, straight_opt, 0, STEPS)}
    del straight_model, straight_opt
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        runs, previous = [], None
        for i, (r, s) in enumerate(HSDP_CHAIN):
            mesh = {"dp_replicate_size": r, "dp_shard_size": s}
            model, opt = sharded(seed=0 if previous is None else 100 + i, config=mesh)
            loaded = None
            if previous is not None:
                shardcore.load(model, previous, opt)
                loaded = {"params": full(model), "optim": optimizer_state(model, opt)}
            losses = train(model, opt, 2 * i, 2 * i + 2)
            saved = {"params": full(model), "optim": optimizer_state(model, opt)}
            previous = d / f"hsdp-{kind}-{r}x{s}"
            shardcore.save(model, previous, opt, state_dict_type=kind)
            runs.append({"layout": [r, s], "loaded": loaded, "saved": saved, "losses": losses})
            del model, opt
        out[kind] = runs
    write(d, "hsdp_chain.pt", out)


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


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    scenario, d = sys.argv[1], Path(sys.argv[2])
    if scenario == "kill":
        kill(d, sys.argv[3])
    else:
        {
            "train_save": train_save,
            "world1": world1,
            "world1_killed": world1_killed,
            "resume": resume,
            "efficient": efficient,
            "hsdp_chain": hsdp_chain,
            "sliced": sliced,
        }[scenario](d)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
