"""How long a CheckpointManager save blocks the training loop, asynchronous against synchronous.

2 ranks (FSDP2 over gloo on the CPU, NCCL on CUDA) shard one Llama of about 100M parameters
(``--size 100m``) and take a step with AdamW, so the optimizer holds state. Then each rank saves
through ``shardcore.CheckpointManager`` in both modes, alternating (sync, async, async, sync, ...),
for FULL and for SHARDED checkpoints. For each save it records:

* ``blocked_s``: the wall time of ``save()``, which is what the loop waits for;
* ``done_s`` (async): the time until the write was committed (``wait()``);
* ``staged_bytes``: the CPU memory an async save holds while it writes: each rank's copy of its
  shards of the model and the optimizer (FSDP2 keeps it from one save to the next), and for FULL on
  rank 0 the whole state the background gather builds.

It prints median(async blocked) / median(sync blocked) per format (goal <= 0.25) and writes
``bench/results/checkpoint.json``.

    python bench/checkpoint.py                     # 100M parameters, 3 saves per mode
    python bench/checkpoint.py --size tiny --repeats 1    # seconds: the smoke test
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import LLAMA_SIZES, build_llama, rank_device, run_ranks, write_result  # noqa: E402

SIZES = ("100m", "tiny")
KINDS = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")


def _staged_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer, kind: str, rank: int) -> int:
    """What an async save keeps in CPU memory while it writes, on this rank."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    shards = sum(local(p) for p in params) + sum(
        local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    if kind == "SHARDED_STATE_DICT" or rank != 0:
        return shards
    whole = sum(p.numel() * p.element_size() for p in params)
    return shards + whole * 3  # and, while the background gather runs, the weights and AdamW's moments


def _rank(rank: int, world: int, size: str, repeats: int, root: str) -> dict:
    import shardcore

    device = rank_device(rank)
    model = shardcore.shard(build_llama(size).to(device), {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    spec = LLAMA_SIZES[size]
    ids = torch.randint(
        0, spec["vocab_size"], (spec["batch"] * world, spec["seq"]), generator=torch.Generator().manual_seed(0)
    )
    b = shardcore.handle(model).backend.local_batch({"input_ids": ids, "labels": ids})
    model(**b).loss.backward()
    opt.step()
    opt.zero_grad()
    params = sum(p.numel() for p in build_llama(size).parameters()) if rank == 0 else None
    out: dict = {"params": params, "kinds": {}}
    step = 0
    for kind in KINDS:
        times: dict[str, list[float]] = {"sync": [], "async": [], "async_done": []}
        order = ["sync", "async", "async", "sync"] * repeats
        for mode in order[: 2 * repeats]:
            d = Path(root) / f"{kind}-{mode}"
            manager = shardcore.CheckpointManager(d, keep_last=1, state_dict_type=kind, async_save=mode == "async")
            step += 1
            shardcore.handle(model).backend.barrier()
            t0 = time.perf_counter()
            manager.save(step, model, opt)
            blocked = time.perf_counter() - t0
            manager.wait()
            done = time.perf_counter() - t0
            times[mode].append(blocked)
            if mode == "async":
                times["async_done"].append(done)
            manager.close()
            shardcore.handle(model).backend.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
        out["kinds"][kind] = {**times, "staged_bytes": _staged_bytes(model, opt, kind, rank)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="100m")
    p.add_argument("--repeats", type=int, default=3, help="saves per mode and format")
    p.add_argument("--out", help="result file (default bench/results/checkpoint.json)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shardcore-bench-ckpt-", dir=None) as root:
        ranks = run_ranks(_rank, 2, (args.size, args.repeats, root), timeout_s=1800)
    result: dict = {"size": args.size, "params": ranks[0]["params"], "world_size": 2, "kinds": {}}
    print(f"{ranks[0]['params'] / 1e6:.1f}M parameters on 2 ranks; blocked = the wall time of save()")
    for kind in KINDS:
        # the loop is blocked until the slowest rank returns
        sync = statistics.median(max(r["kinds"][kind]["sync"][i] for r in ranks) for i in range(args.repeats))
        asyn = statistics.median(max(r["kinds"][kind]["async"][i] for r in ranks) for i in range(args.repeats))
        done = statistics.median(max(r["kinds"][kind]["async_done"][i] for r in ranks) for i in range(args.repeats))
        staged = [r["kinds"][kind]["staged_bytes"] for r in ranks]
        ratio = asyn / sync
        result["kinds"][kind] = {
            "sync_blocked_s": sync,
            "async_blocked_s": asyn,
            "async_done_s": done,
            "ratio": ratio,
            "staged_bytes_per_rank": staged,
            "per_rank": [r["kinds"][kind] for r in ranks],
        }
        print(
            f"{kind:<19} sync {sync:6.2f} s   async {asyn:6.2f} s (written after {done:6.2f} s)   "
            f"async/sync {ratio:.3f} (goal <= 0.25)   staged MiB per rank {[round(b / 2**20) for b in staged]}"
        )
    path = write_result("checkpoint" if args.size == "100m" else f"checkpoint-{args.size}", result, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
