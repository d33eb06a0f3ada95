"""Step-time overhead of ``shardcore.shard`` against the same sharding written by hand.

FSDP2 part (always): 2 gloo ranks (NCCL on CUDA) train one tiny Llama sharded by
``shardcore.shard(model, {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})`` and an identical copy
sharded by hand-written ``fully_shard`` calls (each decoder layer, then the root: the same units).
Both live in the same processes and train in alternating steps (ABBA order), so machine noise hits
both alike; the printed figure is median(shardcore step) / median(hand-written step). Goal <= 1.01.

XLA part (``--xla``): the same comparison for the XLA backend in both modes, on 2 PJRT CPU devices
(``PJRT_DEVICE=CPU CPU_NUM_DEVICES=2``):

* SPMD: against hand-written torch_xla SPMD FSDP (``SpmdFullyShardedDataParallel`` over a
  ("fsdp", "model") mesh), one process, ``torch_xla.sync()`` after every step;
* XLA FSDP: against hand-written nested ``XlaFullyShardedDataParallel`` (each decoder layer, then the
  root), both on 2 device threads under ``xmp.spawn`` with the same CPU recipe (serialized step sync,
  unpinned collective layouts, ``PJRT_CPU_ASYNC_CLIENT=0``). Besides step times it reports the CPU
  time of the whole process per step (both devices' work; the two variants never overlap) and the
  XLA compilations during the timed steps (goal 0).

    python bench/overhead.py                 # FSDP2, writes bench/results/overhead.json
    python bench/overhead.py --xla           # and the XLA backend, if it is installed
    python bench/overhead.py --size tiny --steps 4    # seconds: the smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    LLAMA_SIZES,
    batch,
    build_llama,
    device_type,
    rank_device,
    run_ranks,
    summary,
    synchronize,
    write_result,
)

CONFIG = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True}


def _hand_fsdp2(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """What a user would write without shardcore (torchtitan style): the same units as CONFIG."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def _timed_step(model, opt, data, sync) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one training step."""
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = model(**data).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - t0, time.process_time() - c0


def fsdp2_rank(rank: int, world_size: int, size: str, steps: int, warmup: int, threads: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardcore

    torch.set_num_threads(threads)
    from shardcore.devices import process_group_backend

    device = rank_device(rank)
    dist.init_process_group(process_group_backend(device.type))
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))

    models = {
        "shardcore": shardcore.shard(build_llama(size).to(device), CONFIG),
        "hand": _hand_fsdp2(build_llama(size).to(device), mesh),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}

    def sync():
        synchronize(device)
        dist.barrier()

    times: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    for i in range(warmup + steps):
        order = ["shardcore", "hand"] if i % 2 == 0 else ["hand", "shardcore"]
        data = batch(size, i, rank, device)
        for k in order:
            t, c = _timed_step(models[k], opts[k], data, sync)
            if i >= warmup:
                times[k].append(t)
                cpu[k].append(c)
    # the same numbers, or the comparison compares different work (CUDA: atomics in backward make
    # near-zero gradients differ slightly, and AdamW turns that into steps of up to lr)
    atol = 1e-3 if device.type != "cpu" else 1e-7
    for (a, pa), (b, pb) in zip(models["shardcore"].named_parameters(), models["hand"].named_parameters()):
        assert a == b and torch.allclose(pa.full_tensor(), pb.full_tensor(), rtol=1e-5, atol=atol), (
            f"parameters diverged at {a}"
        )
    dist.destroy_process_group()
    return {"wall": times, "cpu": cpu}


def run_fsdp2(size: str, steps: int, warmup: int, world_size: int = 2, timeout_s: float = 1200) -> dict:
    threads = max(1, (os.cpu_count() or 2) // world_size) if device_type() == "cpu" else 4
    per_rank = run_ranks(fsdp2_rank, world_size, (size, steps, warmup, threads), timeout_s=timeout_s)
    times = per_rank[0]["wall"]  # every rank's step ends in a barrier: rank 0's times are the world's
    sc, hand = times["shardcore"], times["hand"]
    paired = [a / b for a, b in zip(sc, hand)]
    # CPU seconds summed over ranks: less sensitive than wall time to other jobs on a shared machine
    cpu = {k: [sum(r["cpu"][k][i] for r in per_rank) for i in range(steps)] for k in ("shardcore", "hand")}
    return {
        "backend": "fsdp2",
        "world_size": world_size,
        "device": device_type(),
        "model": {"size": size, **LLAMA_SIZES[size]},
        "steps": steps,
        "warmup": warmup,
        "step_s": {"shardcore": summary(sc), "hand_written": summary(hand)},
        "ratio_of_medians": statistics.median(sc) / statistics.median(hand),
        "paired_ratio": summary(paired),
        "cpu_s": {"shardcore": summary(cpu["shardcore"]), "hand_written": summary(cpu["hand"])},
        "cpu_ratio_of_medians": statistics.median(cpu["shardcore"]) / statistics.median(cpu["hand"]),
        "goal": "ratio <= 1.01",
    }


# ------------------------------------------------------------------------------------------ XLA


def xla_available() -> tuple[bool, str]:
    try:
        import shardcore

        ok, reason = shardcore.get_backend("xla").is_available()
    except Exception as e:  # noqa: BLE001 - BackendNotFoundError, or a backend still being written
        return False, f"{type(e).__name__}: {e}"
    return ok, reason


def run_xla(size: str, steps: int, warmup: int, timeout_s: float = 1800, mode: str = "spmd") -> dict:
    """In a child process: PJRT/SPMD settings are global to a process and must precede torch_xla."""
    import json
    import tempfile

    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    env.pop("USE_TORCH_XLA", None)
    child = "--_xla-child" if mode == "spmd" else "--_xla-fsdp-child"
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, child, f.name, "--size", size, "--steps", str(steps), "--warmup", str(warmup)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            return {"backend": "xla", "error": out.stderr[-4000:]}
        return json.loads(Path(f.name).read_text())


def _xla_child(path: str, size: str, steps: int, warmup: int) -> None:
    import json

    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    import shardcore

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    xs.set_global_mesh(mesh)
    device = torch_xla.device()

    def shard_output(output, mesh):  # the Trainer's, for every wrapped module's output
        real = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else output.logits
        xs.mark_sharding(real, mesh, ("fsdp", None, None))

    def hand(model):  # the Trainer's own FSDPv2 wrapping, written out
        import functools

        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        return FSDPv2(model, mesh=mesh, shard_output=shard_output, auto_wrap_policy=policy)

    def input_sharded(data):
        for v in data.values():
            xs.mark_sharding(v, mesh, ("fsdp", None))
        return data

    models = {
        "shardcore": shardcore.shard(build_llama(size).to(device), {**CONFIG, "xla": True, "xla_fsdp_v2": True}),
        "hand": hand(build_llama(size).to(device)),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    losses: dict[str, list[float]] = {k: [] for k in models}
    global_bs = LLAMA_SIZES[size]["batch"] * n
    for i in range(warmup + steps):
        order = ["shardcore", "hand"] if i % 2 == 0 else ["hand", "shardcore"]
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, LLAMA_SIZES[size]["vocab_size"], (global_bs, LLAMA_SIZES[size]["seq"]), generator=g)
        for k in order:
            data = input_sharded({"input_ids": ids.to(device), "labels": ids.to(device)})
            torch_xla.sync()
            xm_wait()
            t0 = time.perf_counter()
            loss = models[k](**data).loss
            loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            torch_xla.sync()
            xm_wait()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
            losses[k].append(float(loss.detach().cpu()))
    sc, hd = times["shardcore"], times["hand"]
    # the same work: both start from one seed and see the same batches
    gap = max(abs(a - b) for a, b in zip(losses["shardcore"], losses["hand"]))
    assert gap < 1e-3 * max(1.0, abs(losses["hand"][0])), f"XLA losses diverged by {gap}"
    Path(path).write_text(
        json.dumps(
            {
                "backend": "xla",
                "mode": "SPMD FSDPv2",
                "devices": n,
                "device": "PJRT CPU",
                "model": {"size": size, **LLAMA_SIZES[size]},
                "steps": steps,
                "warmup": warmup,
                "step_s": {"shardcore": summary(sc), "hand_written": summary(hd)},
                "ratio_of_medians": statistics.median(sc) / statistics.median(hd),
                "paired_ratio": summary([a / b for a, b in zip(sc, hd)]),
                "max_loss_gap": gap,
                "goal": "ratio <= 1.01",
            }
        )
    )


def _xla_fsdp_child(path: str, size: str, steps: int, warmup: int) -> None:
    """XLA FSDP on 2 CPU device threads: shardcore against the same wrapping written by hand."""
    import functools

    import shardcore

    # seeding inside device threads races (one global generator): build the weights once, here
    init = build_llama(size).state_dict()
    shardcore.get_backend("xla").run_on_devices(
        functools.partial(_xla_fsdp_device, path=path, size=size, steps=steps, warmup=warmup, init=init)
    )


_HAND_RECIPE: dict = {}
_BUILD_LOCK = __import__("threading").Lock()


def _hand_serialized_sync(n: int) -> None:
    """The CPU recipe as a hand-written torch_xla script has it: barrier, lock, sync, barrier."""
    import threading

    import torch_xla

    r = _HAND_RECIPE.setdefault(n, (threading.Lock(), threading.Barrier(n, timeout=120)))
    lock, barrier = r
    barrier.wait()
    with lock:
        torch_xla.sync()
    barrier.wait()


def _xla_fsdp_device(rank: int, path: str, size: str, steps: int, warmup: int, init: dict) -> None:
    import json

    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    import shardcore

    n = xr.world_size()

    def fresh():
        with _BUILD_LOCK:  # Transformers' lazy module loading is not thread-safe
            model = build_llama(size)
        model.load_state_dict(init)
        return model

    def hand(model):
        model.to(torch_xla.device())
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = FSDP(layer, reshard_after_forward=True, pin_layout_in_collective_ops=False)
        return FSDP(model, reshard_after_forward=True, pin_layout_in_collective_ops=False)

    models = {"shardcore": shardcore.shard(fresh(), {**CONFIG, "xla": True}), "hand": hand(fresh())}
    ends = {
        "shardcore": shardcore.handle(models["shardcore"]).backend.step_end,
        "hand": lambda: _hand_serialized_sync(n),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    losses: dict[str, list[float]] = {k: [] for k in models}
    compiles = 0
    for i in range(warmup + steps):
        if i == warmup:
            compiles = met.counter_value("UncachedCompile") or 0
        order = ["shardcore", "hand"] if i % 2 == 0 else ["hand", "shardcore"]
        for k in order:
            data = batch(size, i, rank, torch_xla.device())
            _hand_serialized_sync(n)  # inputs on the devices, both devices idle
            xm_wait()
            _HAND_RECIPE[n][1].wait()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = models[k](**data).loss
            loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            ends[k]()
            xm_wait()
            _HAND_RECIPE[n][1].wait()  # both devices' work of this step lies inside [t0, now]
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)  # the whole process: both devices, one variant
            losses[k].append(float(loss.detach().cpu()))
    compiled = (met.counter_value("UncachedCompile") or 0) - compiles
    if rank != 0:
        return
    sc, hd = times["shardcore"], times["hand"]
    gap = max(abs(a - b) for a, b in zip(losses["shardcore"], losses["hand"]))
    assert gap < 1e-3 * max(1.0, abs(losses["hand"][0])), f"XLA FSDP losses diverged by {gap}"
    Path(path).write_text(
        json.dumps(
            {
                "backend": "xla-fsdp",
                "mode": "XLA FSDP (XlaFullyShardedDataParallel), device threads",
                "devices": n,
                "device": "PJRT CPU",
                "model": {"size": size, **LLAMA_SIZES[size]},
                "steps": steps,
                "warmup": warmup,
                "step_s": {"shardcore": summary(sc), "hand_written": summary(hd)},
                "ratio_of_medians": statistics.median(sc) / statistics.median(hd),
                "paired_ratio": summary([a / b for a, b in zip(sc, hd)]),
                "cpu_s": {"shardcore": summary(cpu["shardcore"]), "hand_written": summary(cpu["hand"])},
                "cpu_ratio_of_medians": statistics.median(cpu["shardcore"]) / statistics.median(cpu["hand"]),
                "compiles_after_warmup": compiled,
                "max_loss_gap": gap,
                "goal": "CPU time ratio <= 1.01, 0 compilations after warm-up",
            }
        )
    )


def xm_wait() -> None:
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


# ------------------------------------------------------------------------------------------ main


def report(r: dict) -> str:
    if "error" in r:
        return f"{r['backend']}: FAILED\n{r['error']}"
    if "skipped" in r:
        return f"{r['backend']}: skipped ({r['skipped']})"
    s = r["step_s"]
    return (
        f"{r['backend']:<6} median step  shardcore {s['shardcore']['median'] * 1e3:8.1f} ms   hand-written "
        f"{s['hand_written']['median'] * 1e3:8.1f} ms   ratio shardcore/hand-written {r['ratio_of_medians']:.3f} "
        f"(paired median {r['paired_ratio']['median']:.3f}, IQR {r['paired_ratio']['q1']:.3f}-{r['paired_ratio']['q3']:.3f}, "
        f"n={r['steps']})"
        + (f"; CPU time ratio {r['cpu_ratio_of_medians']:.3f}" if "cpu_ratio_of_medians" in r else "")
        + (f"; compilations after warm-up {r['compiles_after_warmup']}" if "compiles_after_warmup" in r else "")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(LLAMA_SIZES), default="full")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (XLA: graph compiles)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument(
        "--xla", action="store_true", help="also compare the XLA backend with hand-written torch_xla SPMD FSDP"
    )
    ap.add_argument("--out", help="result JSON (default bench/results/overhead.json)")
    ap.add_argument("--_xla-child", dest="xla_child", help=argparse.SUPPRESS)
    ap.add_argument("--_xla-fsdp-child", dest="xla_fsdp_child", help=argparse.SUPPRESS)
    ap.add_argument("--only-xla", action="store_true", help="skip the FSDP2 comparison (with --xla)")
    args = ap.parse_args(argv)
    if args.xla_child:
        _xla_child(args.xla_child, args.size, args.steps, args.warmup)
        return 0
    if args.xla_fsdp_child:
        _xla_fsdp_child(args.xla_fsdp_child, args.size, args.steps, args.warmup)
        return 0

    results = []
    if not args.only_xla:
        results.append(run_fsdp2(args.size, args.steps, args.warmup, args.world_size))
        print(report(results[-1]), flush=True)
    if args.xla or args.only_xla:
        ok, reason = xla_available()
        for mode in ("spmd", "fsdp"):
            results.append(
                run_xla(args.size, args.steps, args.warmup, mode=mode)
                if ok
                else {"backend": f"xla-{mode}", "skipped": reason}
            )
            print(report(results[-1]), flush=True)
    path = write_result("overhead", {"results": results}, args.out)
    print(f"written: {path}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
