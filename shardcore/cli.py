"""``shardcore`` command line: ``plan`` (units and per-rank memory), ``backends``, and ``conformance``
(the ``shardcore-conformance`` suite)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from torch import nn

from .backend import available_backends
from .config import parse_config
from .errors import ShardcoreError
from .plan import build_plan, estimate_memory
from .validate import data_parallel_shape


def load_model(spec: str) -> nn.Module:
    """``package.module:factory`` (called with no arguments) or a directory with a Hugging Face
    ``config.json`` (built with random weights, on the meta device: no weights are read)."""
    path = Path(spec)
    if path.is_dir() or spec.endswith("config.json"):
        cfg_dir = path if path.is_dir() else path.parent
        if not (cfg_dir / "config.json").is_file():
            raise ShardcoreError(f"shardcore plan --model: {spec!r} has no config.json.")
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_cfg = AutoConfig.from_pretrained(cfg_dir)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_cfg)
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        raise ShardcoreError(
            f"shardcore plan --model: {spec!r} is neither a directory with config.json nor "
            "'module:factory'. Example: --model shardcore_conformance.models:build_llama"
        )
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ShardcoreError(f"shardcore plan --model: cannot import {spec!r} ({e}).") from None
    model = factory()
    if not isinstance(model, nn.Module):
        raise ShardcoreError(
            f"shardcore plan --model: {spec!r} returned {type(model).__name__}, not a torch.nn.Module."
        )
    return model


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = parse_config(args.config)
    model = load_model(args.model)
    plan = build_plan(model, cfg)
    # under HSDP each replica group holds one whole copy, sharded over dp_shard_size ranks
    replicas, shards = data_parallel_shape(cfg, args.world_size)
    est = estimate_memory(model, shards)
    if args.json:
        print(
            json.dumps(
                {
                    "backend": cfg.backend_name,
                    "policy": plan.policy,
                    "units": [{"path": u.path, "class": u.cls, "num_params": u.num_params} for u in plan.all_units()],
                    "world_size": args.world_size,
                    "dp_replicate_size": replicas,
                    "dp_shard_size": shards,
                    "per_rank_bytes": {
                        "params": est.param_bytes,
                        "grads": est.grad_bytes,
                        "adamw_state": est.optim_bytes,
                        "total": est.total,
                    },
                    "full_param_bytes": est.full_param_bytes,
                },
                indent=2,
            )
        )
        return 0
    print(f"backend: {cfg.backend_name}")
    print(plan.describe())
    print()
    mesh = f", dp_replicate {replicas} x dp_shard {shards}" if replicas > 1 else ""
    print(f"estimated bytes per rank at world size {args.world_size}{mesh} (largest shard, rank 0):")
    print(f"  params      {_fmt_bytes(est.param_bytes):>12}")
    print(f"  grads       {_fmt_bytes(est.grad_bytes):>12}")
    print(f"  AdamW state {_fmt_bytes(est.optim_bytes):>12}")
    print(f"  total       {_fmt_bytes(est.total):>12}   (unsharded params: {_fmt_bytes(est.full_param_bytes)})")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    for b in available_backends():
        print(f"{b.name:<12} {'available' if b.available else 'unavailable':<12} {b.reason}")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        from shardcore_conformance.cli import main as conformance_main
    except ImportError:
        raise ShardcoreError(
            "shardcore conformance needs the shardcore-conformance package: pip install -e conformance"
        ) from None
    return conformance_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardcore", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan", help="print the sharding units and the estimated per-rank memory")
    pp.add_argument("--config", required=True, help="JSON FSDP config or accelerate YAML")
    pp.add_argument("--model", required=True, help="module:factory, or a directory with a Hugging Face config.json")
    pp.add_argument("--world-size", type=int, default=1)
    pp.add_argument("--json", action="store_true", help="machine-readable output")
    pp.set_defaults(func=cmd_plan)
    pb = sub.add_parser("backends", help="list registered backends and whether they can run here")
    pb.set_defaults(func=cmd_backends)
    pc = sub.add_parser(
        "conformance", help="run the conformance suite (same options as shardcore-conformance)", add_help=False
    )
    pc.add_argument("rest", nargs=argparse.REMAINDER)
    pc.set_defaults(func=cmd_conformance)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["conformance"]:
        # everything after the word belongs to the suite's own parser
        args = argparse.Namespace(func=cmd_conformance, rest=argv[1:])
    else:
        args = p.parse_args(argv)
    try:
        return args.func(args)
    except ShardcoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
