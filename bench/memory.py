"""Bytes each rank holds after ``shardcore.shard``: parameters, gradients and AdamW state.

For world sizes 1, 2 and 4 (gloo ranks on CPU, or NCCL ranks on as many GPUs as there are), a tiny
Llama ("full": dims that 4 divides; "odd": dims that no world size divides, so the last shard is
padded) is sharded, one AdamW step is taken (so gradients and optimizer state exist), and each rank
counts the bytes of the storage behind its local shards (padding included; a flat buffer shared by
several gradients is counted once). The figure printed is

    per-rank bytes / (unsharded bytes / world size)        goal <= 1.02

for the largest rank, and the `shardcore plan` estimate (``shardcore.estimate_memory``) beside the
measurement as estimate / measured.

    python bench/memory.py                      # writes bench/results/memory.json
    python bench/memory.py --sizes tiny --world-sizes 1 2
    python bench/memory.py --lora 8             # a PEFT LoRA model (rank 8 on q_proj and v_proj)

With ``--lora`` the base is frozen: only the adapters have gradients and AdamW state, the optimizer is
built over the trainable parameters as LoRA users do, and ``frozen_base`` says what the frozen base
costs per rank against full fine-tuning of the same model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import LLAMA_SIZES, batch, build_llama, device_type, rank_device, run_ranks, write_result  # noqa: E402

CONFIG = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
KINDS = ("params", "grads", "adamw_state")


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _model(size: str, lora: int) -> torch.nn.Module:
    model = build_llama(size)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=["q_proj", "v_proj"]))


def memory_rank(rank: int, world_size: int, size: str, lora: int = 0) -> dict:
    import shardcore

    torch.set_num_threads(1)
    device = rank_device(rank)
    model = shardcore.shard(_model(size, lora).to(device), CONFIG)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model(**batch(size, 0, rank, device)).loss.backward()
    opt.step()  # AdamW state exists from the first step; keep the gradients for the count
    params = list(model.parameters())
    state = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    out = {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params),
        "adamw_state": _storage_bytes(state),
    }
    if device.type != "cpu":
        out["accelerator_memory_allocated"] = torch.accelerator.memory_allocated(device)
    return out


def run(size: str, world_sizes: list[int], timeout_s: float = 900, lora: int = 0) -> dict:
    import shardcore

    full_model = _model(size, lora)
    full = {
        "params": sum(p.numel() * p.element_size() for p in full_model.parameters()),
        "grads": sum(p.numel() * p.element_size() for p in full_model.parameters() if p.requires_grad),
        "adamw_state": sum(2 * p.numel() * 4 for p in full_model.parameters() if p.requires_grad),
    }
    rows = []
    for ws in world_sizes:
        if device_type() != "cpu" and ws > torch.accelerator.device_count():
            rows.append({"world_size": ws, "skipped": f"{torch.accelerator.device_count()} {device_type()} device(s)"})
            continue
        per_rank = run_ranks(memory_rank, ws, (size, lora), timeout_s=timeout_s)
        est = shardcore.estimate_memory(full_model, ws)
        estimate = {"params": est.param_bytes, "grads": est.grad_bytes, "adamw_state": est.optim_bytes}
        largest = max(range(ws), key=lambda r: sum(per_rank[r][k] for k in KINDS))
        total_full = sum(full.values())
        rows.append(
            {
                "world_size": ws,
                "per_rank_bytes": per_rank,
                "ideal_bytes_per_rank": {k: full[k] / ws for k in KINDS},
                "ratio_to_ideal": {  # largest rank's bytes / (full / world size)
                    **{k: max(r[k] for r in per_rank) / (full[k] / ws) for k in KINDS},
                    "total": sum(per_rank[largest][k] for k in KINDS) / (total_full / ws),
                },
                "estimate_bytes": {**estimate, "total": est.total},
                "estimate_over_measured": {  # rank 0: the estimate is rank 0's (largest) shard
                    **{k: estimate[k] / per_rank[0][k] if per_rank[0][k] else float(estimate[k] == 0) for k in KINDS},
                    "total": est.total / sum(per_rank[0][k] for k in KINDS),
                },
                # what training costs beyond the weights, per rank, against full fine-tuning (2 fp32 AdamW
                # moments and a gradient per parameter): a frozen base adds neither
                "frozen_base": {
                    "grads_and_adamw_bytes": sum(per_rank[largest][k] for k in ("grads", "adamw_state")),
                    "full_fine_tuning_bytes": sum(p.numel() * (p.element_size() + 8) for p in full_model.parameters())
                    // ws,
                },
            }
        )
    return {
        "model": {
            "size": size,
            **LLAMA_SIZES[size],
            "params": sum(p.numel() for p in full_model.parameters()),
            "trainable_params": sum(p.numel() for p in full_model.parameters() if p.requires_grad),
            "lora_rank": lora,
        },
        "device": device_type(),
        "config": CONFIG,
        "full_bytes": full,
        "rows": rows,
        "goal": "ratio_to_ideal.total <= 1.02",
    }


def report(r: dict) -> str:
    lines = [
        f"memory per rank, tiny Llama '{r['model']['size']}' ({r['model']['params']:,} params, {r['device']})",
        f"{'world':>5}  {'params':>7} {'grads':>7} {'adamw':>7} {'total':>7}   ratio to full/world   "
        f"{'estimate/measured (total)':>26}",
    ]
    for row in r["rows"]:
        if "skipped" in row:
            lines.append(f"{row['world_size']:>5}  skipped: {row['skipped']}")
            continue
        q = row["ratio_to_ideal"]
        lines.append(
            f"{row['world_size']:>5}  {q['params']:7.3f} {q['grads']:7.3f} {q['adamw_state']:7.3f} {q['total']:7.3f}"
            f"{'':24}{row['estimate_over_measured']['total']:7.3f}"
        )
        if r["model"]["lora_rank"]:
            fb = row["frozen_base"]
            lines.append(
                f"       LoRA r={r['model']['lora_rank']}: gradients + AdamW state {fb['grads_and_adamw_bytes']:,} bytes "
                f"per rank, full fine-tuning {fb['full_fine_tuning_bytes']:,} "
                f"({fb['grads_and_adamw_bytes'] / fb['full_fine_tuning_bytes']:.4f}x)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", choices=sorted(LLAMA_SIZES), nargs="+", default=["full", "odd"])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="a PEFT LoRA model of rank R (base frozen)")
    ap.add_argument("--out", help="result JSON (default bench/results/memory.json)")
    args = ap.parse_args(argv)
    runs = []
    for size in args.sizes:
        runs.append(run(size, args.world_sizes, lora=args.lora))
        print(report(runs[-1]), flush=True)
    path = write_result("memory", {"runs": runs}, args.out)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
