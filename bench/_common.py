"""Shared by the benchmark scripts: the model, rank launching with a deadline, machine description."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"

# "full": a step takes ~100 ms on one CPU core per rank; "tiny": seconds for a smoke test.
LLAMA_SIZES = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        seq=16,
        batch=2,
    ),
    "full": dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        seq=64,
        batch=4,
    ),
    # dim-0 sizes that no world size divides: shows the padding of the last shard
    "odd": dict(
        vocab_size=1001,
        hidden_size=130,
        intermediate_size=345,
        num_hidden_layers=3,
        num_attention_heads=5,
        num_key_value_heads=5,
        seq=64,
        batch=4,
    ),
    # about 106M parameters: 2 x 32000 x 768 embeddings and 8 decoder layers of width 768 (checkpoint.py)
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=12,
        seq=64,
        batch=2,
    ),
    # for a GPU: big enough that the step is compute-bound
    "gpu": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        seq=2048,
        batch=4,
    ),
}


def build_llama(size: str, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = {k: v for k, v in LLAMA_SIZES[size].items() if k not in ("seq", "batch")}
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        max_position_embeddings=max(LLAMA_SIZES[size]["seq"], 64),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **kw,
    )
    return LlamaForCausalLM(cfg)


def batch(size: str, step: int, rank: int, device: Any = "cpu") -> dict[str, torch.Tensor]:
    s = LLAMA_SIZES[size]
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, s["vocab_size"], (s["batch"], s["seq"]), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    if device_type() != "cpu":
        from shardcore.devices import describe

        d = describe(torch.device(device_type(), 0))
        out["accelerator"], out["accelerator_name"] = d["type"], d["name"]
        out["accelerators"] = torch.accelerator.device_count()
        if "runtime" in d:
            out["accelerator_runtime"] = d["runtime"]
        if device_type() == "cuda":  # sets the cuBLAS workspace size (shardcore.workspaces)
            out["accelerator_capability"] = list(torch.cuda.get_device_capability(0))
    from importlib import metadata

    for dist in ("transformers", "torch_xla"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        out["load_average_1_5_15min"] = list(os.getloadavg())  # other jobs on the machine: noise
    except OSError:  # pragma: no cover
        pass
    return out


def summary(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def write_result(name: str, data: dict[str, Any], out: str | None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(), **data}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str, env: dict) -> None:
    os.environ.update(env)
    os.environ.setdefault("USE_TORCH_XLA", "0")
    from shardcore_conformance.launch import torchrun_env

    os.environ.update(torchrun_env(rank, world_size, port))
    result = fn(rank, world_size, *args)
    tmp = Path(out_dir) / f".{rank}.json"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, Path(out_dir) / f"{rank}.json")


def run_ranks(
    fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 600, env: dict | None = None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes with the torchrun environment;
    return each rank's (JSON-able) result. Killed and raised after ``timeout_s``. On the CPU the ranks
    are forks of a server that imported torch and Transformers once (5 s of CPU per rank saved on a
    small machine); with an accelerator they are fresh interpreters, as forking around a device
    context is unsafe."""
    from shardcore_conformance.launch import cpu_fork_method, free_port

    # the whole environment: a fork server's children would otherwise see the server's
    env = {**os.environ, **(env or {})}
    method = "spawn" if torch.accelerator.is_available() else cpu_fork_method(env)
    with tempfile.TemporaryDirectory(prefix="shardcore-bench-") as tmp:
        ctx = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), fn, args, tmp, env),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        deadline = time.time() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.time() > deadline:
                    raise TimeoutError(f"benchmark ranks did not finish within {timeout_s:g}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world_size)]


def device_type() -> str:
    """The accelerator torch reports here (``torch.accelerator``: cuda, xpu, hpu, mps, ...), else cpu."""
    from shardcore.devices import accelerator

    return accelerator() or "cpu"


def rank_device(rank: int) -> torch.device:
    """Rank ``rank``'s device, made current: the accelerator's device ``rank``, else the CPU."""
    t = device_type()
    if t == "cpu":
        return torch.device("cpu")
    torch.accelerator.set_device_index(rank)
    return torch.device(t, rank)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (the CPU has none)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
