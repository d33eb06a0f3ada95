"""Peak CPU memory of each rank while loading a model: every rank reading, rank 0 reading and
broadcasting, and every rank reading only its own slices.

    python bench/load_memory.py                       # ~134M-parameter Llama, 2 and 4 ranks, all modes
    python bench/load_memory.py --nproc 2 --layers 4 --out bench/results/load_memory.md

Builds a Llama from a ``LlamaConfig`` (random weights, nothing downloaded), saves it once with
``save_pretrained``, then loads it on N ranks (torchrun, FSDP2 on CPU/gloo) three ways, each in new
processes:

* ``every rank reads``: ``shardcore.from_pretrained`` without ``cpu_ram_efficient_loading`` (each
  rank runs Transformers' ``from_pretrained``, then shards);
* ``rank 0 broadcasts``: the path shardcore (like accelerate) took before sliced loading: rank 0
  runs ``from_pretrained``, the other ranks build on the meta device, and ``shard`` broadcasts;
* ``sliced``: ``shardcore.from_pretrained`` with ``cpu_ram_efficient_loading`` on FSDP2: every rank
  builds the model without weights, shards it and reads only its own rows of each tensor.

Each rank resets its peak RSS (``/proc/self/clear_refs``) just before the load (after loading a tiny
model the same way, so imports are not counted) and reads it (``VmHWM``, which counts the file pages a
memory map touched) after sharding. The table shows each rank's peak growth over its RSS before the
load, and that growth over the goal's unit, model bytes / N (goal for ``sliced``: <= 1.15). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("every rank reads", "rank 0 broadcasts", "sliced")
GOAL = 1.15


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _load(mode: str, model_dir: str):
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import shardcore

    if mode == "every rank reads":
        return shardcore.from_pretrained(AutoModelForCausalLM, model_dir, {})
    if mode == "sliced":
        return shardcore.from_pretrained(AutoModelForCausalLM, model_dir, {"cpu_ram_efficient_loading": True})
    if dist.get_rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return shardcore.shard(model, {"cpu_ram_efficient_loading": True})


def worker(model_dir: str, warmup_dir: str, mode: str, out: str) -> None:
    os.environ.setdefault("USE_TORCH_XLA", "0")
    import torch
    import torch.distributed as dist

    from shardcore.devices import requested
    from shardcore.distributed import ensure_process_group

    torch.set_num_threads(1)
    ensure_process_group(600, requested())
    rank = dist.get_rank()
    # the same calls on a tiny model first, so that imports and one-time set-up are not counted
    _load(mode, warmup_dir)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status_kb("VmRSS")
    t0 = time.time()
    model = _load(mode, model_dir)
    seconds = time.time() - t0
    peak = _status_kb("VmHWM")
    local = sum(p.to_local().numel() for p in model.parameters())
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "before_kb": before, "peak_kb": peak, "seconds": seconds, "local_params": local})
    )
    dist.barrier()
    dist.destroy_process_group()


def build(model_dir: Path, layers: int, hidden: int, vocab: int = 32000) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model-dir", help="an existing save_pretrained directory (default: build one)")
    ap.add_argument("--out", help="also write the table to this Markdown file")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", nargs=4, metavar=("MODEL_DIR", "WARMUP_DIR", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return

    env = {**os.environ, "USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardcore-bench-") as tmp:
        if args.model_dir:
            model_dir, n = Path(args.model_dir), None
        else:
            model_dir = Path(tmp, "model")
            n = build(model_dir, args.layers, args.hidden)
        warmup_dir = Path(tmp, "warmup")
        build(warmup_dir, 1, 64, vocab=256)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        for nproc in args.nproc:
            for mode in MODES:
                out = Path(tmp, f"{nproc}-{mode.replace(' ', '_')}")
                out.mkdir()
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    str(nproc),
                    __file__,
                    "--worker",
                    str(model_dir),
                    str(warmup_dir),
                    mode,
                    str(out),
                ]
                subprocess.run(cmd, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
                for r in range(nproc):
                    got = json.loads(Path(out, f"rank{r}.json").read_text())
                    grow = (got["peak_kb"] - got["before_kb"]) * 1024
                    rows.append(
                        {
                            "ranks": nproc,
                            "mode": mode,
                            "rank": r,
                            "before_mib": got["before_kb"] / 1024,
                            "peak_mib": got["peak_kb"] / 1024,
                            "growth_mib": grow / 2**20,
                            "growth_over_share": grow / (size / nproc),
                            "seconds": got["seconds"],
                        }
                    )

    params = f"{n / 1e6:.0f}M parameters, " if n else ""
    lines = [
        f"load_memory: {params}{size / 2**20:.0f} MiB of safetensors, FSDP2 on CPU/gloo; growth of each rank's "
        f"peak RSS during the load, and that growth / (model bytes / N) (goal for sliced: <= {GOAL})",
        "",
        "| ranks | mode | rank | RSS before (MiB) | peak RSS (MiB) | peak growth (MiB) | growth / (model bytes / N) | load s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {x['ranks']} | {x['mode']} | {x['rank']} | {x['before_mib']:.0f} | {x['peak_mib']:.0f} | "
        f"{x['growth_mib']:.0f} | {x['growth_over_share']:.2f} | {x['seconds']:.1f} |"
        for x in rows
    ]
    worst = {}
    for x in rows:
        key = (x["ranks"], x["mode"])
        worst[key] = max(worst.get(key, 0.0), x["growth_over_share"])
    lines += ["", "worst rank, growth / (model bytes / N):"]
    lines += [f"- {k[0]} ranks, {k[1]}: {v:.2f}" for k, v in worst.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"model_bytes": size, "params": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
