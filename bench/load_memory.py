"""Peak CPU memory of each rank while loading a model, with and without cpu_ram_efficient_loading.

    python bench/load_memory.py                  # ~134M-parameter Llama, 2 ranks, both modes
    python bench/load_memory.py --layers 4 --out bench/results/load_memory.md

Builds a Llama from a ``LlamaConfig`` (random weights, nothing downloaded), saves it once with
``save_pretrained`` to a local directory, then runs ``shardcore.from_pretrained`` on 2 ranks
(torchrun, FSDP2 on CPU/gloo) twice: every rank reading the file, and
``cpu_ram_efficient_loading: true`` (only rank 0 reads; the others build on the meta device and
receive their shards by broadcast). Each rank resets its peak RSS (``/proc/self/clear_refs``) just
before the load (after loading a tiny model the same way, so imports are not counted) and reads it (``VmHWM``) after sharding; the table shows the growth of each rank's
peak over its RSS before the load, and that growth as a ratio to rank 0's in the same run.
Linux only (``/proc``).
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

MODES = {"every rank reads": False, "cpu_ram_efficient_loading": True}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(model_dir: str, warmup_dir: str, efficient: bool, out: str) -> None:
    os.environ.setdefault("USE_TORCH_XLA", "0")
    import torch
    from transformers import AutoModelForCausalLM

    import shardcore
    from shardcore.distributed import ensure_process_group

    torch.set_num_threads(1)
    ensure_process_group(600, torch.cuda.is_available())
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = {"cpu_ram_efficient_loading": efficient}
    # the same calls on a tiny model first, so that imports and one-time set-up are not counted
    shardcore.from_pretrained(AutoModelForCausalLM, warmup_dir, cfg)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status_kb("VmRSS")
    t0 = time.time()
    model = shardcore.from_pretrained(AutoModelForCausalLM, model_dir, cfg)
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
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model-dir", help="an existing save_pretrained directory (default: build one)")
    ap.add_argument("--out", help="also write the table to this Markdown file")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument(
        "--worker", nargs=4, metavar=("MODEL_DIR", "WARMUP_DIR", "EFFICIENT", "OUT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.worker[2] == "1", args.worker[3])
        return

    env = {**os.environ, "USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="shardcore-bench-") as tmp:
        if args.model_dir:
            model_dir, n = Path(args.model_dir), None
        else:
            model_dir = Path(tmp, "model")
            n = build(model_dir, args.layers, args.hidden)
        warmup_dir = Path(tmp, "warmup")
        build(warmup_dir, 1, 64, vocab=256)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        rows = []
        for label, efficient in MODES.items():
            out = Path(tmp, label.replace(" ", "_"))
            out.mkdir()
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(args.nproc),
                __file__,
                "--worker",
                str(model_dir),
                str(warmup_dir),
                "1" if efficient else "0",
                str(out),
            ]
            subprocess.run(cmd, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.nproc)]
            base = ranks[0]["peak_kb"] - ranks[0]["before_kb"]
            for r in ranks:
                grow = r["peak_kb"] - r["before_kb"]
                rows.append(
                    (
                        label,
                        r["rank"],
                        r["before_kb"] / 1024,
                        r["peak_kb"] / 1024,
                        grow / 1024,
                        grow / base,
                        r["seconds"],
                    )
                )

    params = f"{n / 1e6:.0f}M parameters, " if n else ""
    lines = [
        f"load_memory: {params}{size / 2**20:.0f} MiB of safetensors, {args.nproc} ranks (FSDP2, CPU/gloo), "
        "shardcore.from_pretrained(AutoModelForCausalLM, dir, config)",
        "",
        "| mode | rank | RSS before (MiB) | peak RSS (MiB) | peak growth in load (MiB) | growth / rank 0's | load s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {m} | {r} | {b:.0f} | {p:.0f} | {g:.0f} | {ratio:.2f} | {s:.1f} |" for m, r, b, p, g, ratio, s in rows
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
