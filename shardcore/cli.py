"""``shardcore`` command line: ``plan`` (units and per-rank memory), ``backends``, and ``conformance``
(the ``shardcore-conformance`` suite)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from torch import nn

from .backend import available_backends
from .config import parse_config
from .errors import ShardcoreError
from .plan import build_plan, estimate_memory
from .planning import format_bytes
from .validate import data_parallel_shape


def load_model(spec: str, meta: bool = True) -> nn.Module:
    """``package.module:factory`` (called with no arguments) or a directory with a Hugging Face
    ``config.json`` (built with random weights, on the meta device unless ``meta`` is false, e.g.
    under ``FakeTensorMode``: no weights are read)."""
    path = Path(spec)
    if path.is_dir() or spec.endswith("config.json"):
        cfg_dir = path if path.is_dir() else path.parent
        if not (cfg_dir / "config.json").is_file():
            raise ShardcoreError(
                f"shardcore plan --model: {spec!r} has no config.json. Give a directory holding a Hugging Face "
                "config.json, or module:factory."
            )
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            hf_cfg = AutoConfig.from_pretrained(cfg_dir)
        except (ValueError, OSError) as e:
            raise ShardcoreError(f"shardcore plan --model: {spec!r}: its config.json cannot be read ({e}).") from None
        with torch.device("meta") if meta else contextlib.nullcontext():
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
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory: any failure is theirs to read
        raise ShardcoreError(
            f"shardcore plan --model: calling {spec}() failed ({type(e).__name__}: {e}). The factory must build "
            "the model with no arguments."
        ) from None
    if not isinstance(model, nn.Module):
        raise ShardcoreError(
            f"shardcore plan --model: {spec!r} returned {type(model).__name__}, not a torch.nn.Module."
        )
    return model


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = parse_config(args.config)
    if cfg.backend_name != "xla":
        # Transformers would start an XLA runtime in this process otherwise, for nothing
        os.environ.setdefault("USE_TORCH_XLA", "0")
    if args.batch_size is not None or args.seq_len is not None or args.fit or args.device_memory:
        return _plan_peak(args, cfg)
    model = load_model(args.model)
    plan = build_plan(model, cfg)
    # under HSDP each replica group holds one whole copy, sharded over dp_shard_size ranks
    replicas, shards = data_parallel_shape(cfg, args.world_size)
    est = estimate_memory(model, shards, tp=plan.tp)
    unique = {id(p): p for p in model.parameters()}.values()
    counts = {
        "params": sum(p.numel() for p in unique),
        "trainable_params": sum(p.numel() for p in unique if p.requires_grad),
    }
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
                    "tp_size": cfg.tp_size,
                    "per_rank_bytes": {
                        "params": est.param_bytes,
                        "grads": est.grad_bytes,
                        "adamw_state": est.optim_bytes,
                        "total": est.total,
                    },
                    "full_param_bytes": est.full_param_bytes,
                    "async_checkpoint_staging_bytes": {
                        kind: est.async_staging_bytes(kind) for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
                    },
                    **counts,
                },
                indent=2,
            )
        )
        return 0
    print(f"backend: {cfg.backend_name}")
    print(plan.describe())
    print()
    mesh = f", dp_replicate {replicas} x dp_shard {shards}" if replicas > 1 else ""
    if cfg.tp_size > 1:
        mesh = f"{mesh or f', dp_shard {shards}'} x tp_size {cfg.tp_size}"
    print(f"estimated bytes per rank at world size {args.world_size}{mesh} (largest shard, rank 0):")
    print(f"  params      {format_bytes(est.param_bytes, 1):>12}")
    print(f"  grads       {format_bytes(est.grad_bytes, 1):>12}")
    print(f"  AdamW state {format_bytes(est.optim_bytes, 1):>12}")
    if counts["trainable_params"] < counts["params"]:  # a frozen base (LoRA): no gradients, no optimizer state
        share = counts["trainable_params"] / max(counts["params"], 1)
        print(
            f"  (trainable: {counts['trainable_params']:,} of {counts['params']:,} parameters, {share:.1%}; "
            "frozen ones have no gradients and no AdamW state)"
        )
    print(
        f"  total       {format_bytes(est.total, 1):>12}   (unsharded params: {format_bytes(est.full_param_bytes, 1)})"
    )
    print("(model states only: add --batch-size and --seq-len for the peak with activations)")
    print("CPU memory an async checkpoint save holds while it writes (CheckpointManager(async_save=True)):")
    print(
        f"  FULL        {format_bytes(est.async_staging_bytes('FULL_STATE_DICT'), 1):>12}   (rank 0: its shards and the whole)"
    )
    print(
        f"  SHARDED     {format_bytes(est.async_staging_bytes('SHARDED_STATE_DICT'), 1):>12}   (every rank: its shards)"
    )
    return 0


def _plan_peak(args: argparse.Namespace, cfg: Any) -> int:
    """The predicted peak (shardcore.planning), the fit against --device-memory, and --fit."""
    from . import planning

    if args.batch_size is None or args.seq_len is None:
        raise ShardcoreError("shardcore plan: the peak needs --batch-size (per rank) and --seq-len.")
    limit = planning.parse_bytes(args.device_memory) if args.device_memory else None
    if args.fit and limit is None:
        raise ShardcoreError("shardcore plan --fit: needs --device-memory, the memory of one device (e.g. 80GiB).")
    load_model(args.model)  # an unknown or unreadable model fails here, before any planning

    def build() -> nn.Module:
        return load_model(args.model, meta=False)

    allow = tuple(a.strip() for a in args.allow.split(",") if a.strip()) if args.allow else planning.KNOBS
    if args.fit:
        found = planning.fit(build, cfg, args.world_size, args.batch_size, args.seq_len, limit, args.optimizer, allow)
        return _print_fit(args, found, limit)
    plan = planning.predict(
        build, cfg, args.world_size, args.batch_size, args.seq_len, args.optimizer, args.global_batch_size
    )
    doc = plan.to_dict()
    if limit is not None and plan.peak_bytes is not None:
        doc["device_memory"] = limit
        doc["fits"] = max(plan.peak_bytes, plan.first_step_peak_bytes or 0) <= limit
        doc["headroom_bytes"] = limit - max(plan.peak_bytes, plan.first_step_peak_bytes or 0)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(_describe(plan))
    if "fits" in doc:
        verdict = "fits" if doc["fits"] else "does NOT fit"
        print(f"{verdict} in {format_bytes(limit)} per device: headroom {format_bytes(doc['headroom_bytes'])}")
    return 0


def _describe(plan: Any) -> str:
    mesh = (
        f" (dp_replicate {plan.dp_replicate_size} x dp_shard {plan.dp_shard_size})"
        if plan.dp_replicate_size > 1
        else ""
    )
    lines = [
        f"backend {plan.backend} on {plan.device}, world size {plan.world_size}{mesh}, micro-batch {plan.batch_size} x "
        f"{plan.seq_len} tokens per rank, {plan.optimizer}; the largest rank (rank 0):",
    ]
    for part, n in plan.breakdown.items():
        lines.append(f"  {part:<17} {format_bytes(n):>14}")
    lines.append(f"  {'peak (steady)':<17} {format_bytes(plan.peak_bytes):>14}")
    lines.append(f"  {'peak (1st step)':<17} {format_bytes(plan.first_step_peak_bytes):>14}")
    if plan.host_bytes is not None:
        lines.append(f"  {'host (cpu_offload)':<17} {format_bytes(plan.host_bytes):>14}")
    for part, why in plan.not_predicted.items():
        lines.append(f"  not predicted: {part}: {why}")
    lines.append(f"(parts at the moment of the steady peak; planned in {plan.seconds:.1f}s with fake tensors)")
    return "\n".join(lines)


def _print_fit(args: argparse.Namespace, found: Any, limit: int) -> int:
    if not found.fits:
        if found.smallest_world_size:
            msg = (
                f"nothing fits in {format_bytes(limit)} at world size {args.world_size}; the smallest world size that "
                f"would: {found.smallest_world_size} (with every allowed saving, micro-batch 1)"
            )
        else:
            msg = f"nothing fits in {format_bytes(limit)}, even at 4096 ranks with every allowed saving"
        print(
            json.dumps(
                {"fits": False, "smallest_world_size": found.smallest_world_size, "tried": found.tried}, indent=2
            )
            if args.json
            else msg
        )
        return 1
    Path(args.fit_out).write_text(json.dumps(found.config, indent=2) + "\n")
    plan = found.plan
    if args.json:
        print(
            json.dumps(
                {
                    "fits": True,
                    "config": found.config,
                    "batch_size": found.batch_size,
                    "config_file": args.fit_out,
                    "plan": plan.to_dict(),
                    "tried": found.tried,
                },
                indent=2,
            )
        )
        return 0
    print(_describe(plan))
    print(
        f"fits in {format_bytes(limit)} per device with micro-batch {found.batch_size}: headroom "
        f"{format_bytes(limit - max(plan.peak_bytes, plan.first_step_peak_bytes))}; config written to {args.fit_out} "
        "(shardcore.shard takes it as is)"
    )
    print(
        "ranked by expected speed: no cpu_offload (host transfers) first, then the smallest tp_size (collectives in "
        "each split layer), then no activation_checkpointing (recomputation), then the largest micro-batch, then reshard_after_forward false (fewer all-gathers), then "
        f"the config's own precision; {len(found.tried)} plans evaluated"
    )
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
    # the module docstring is reST for the API docs; a terminal shows help as plain text
    p = argparse.ArgumentParser(
        prog="shardcore",
        description="Plan a sharded run (units and per-rank memory), list the installed backends, or run the "
        "conformance suite (shardcore-conformance).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser(
        "plan",
        help="print the sharding units and each rank's memory, or with a batch shape the predicted peak",
        description="Show which modules become sharding units and what each rank holds. With --batch-size and "
        "--seq-len, predict the largest rank's peak memory, activations included, with fake tensors (no memory "
        "allocated, no weights read); with --device-memory, say whether it fits; with --fit, search a config "
        "that fits.",
    )
    pp.add_argument("--config", required=True, help="JSON FSDP config or accelerate YAML")
    pp.add_argument("--model", required=True, help="module:factory, or a directory with a Hugging Face config.json")
    pp.add_argument("--world-size", type=int, default=1, help="ranks to shard over (default: 1)")
    pp.add_argument("--batch-size", type=int, default=None, help="micro-batch per rank (rows): predicts the peak")
    pp.add_argument("--seq-len", type=int, default=None, help="tokens per row")
    pp.add_argument("--global-batch-size", type=int, default=None, help="checked to split into micro-batches")
    pp.add_argument(
        "--optimizer", choices=("adamw", "sgd"), default="adamw", help="whose state the peak counts (default: adamw)"
    )
    pp.add_argument("--device-memory", default=None, help="one device's memory, e.g. 80GiB: says whether it fits")
    pp.add_argument("--fit", action="store_true", help="search a config that fits --device-memory")
    pp.add_argument(
        "--allow",
        default=None,
        help="comma-separated knobs --fit may change (default: all of activation_checkpointing, "
        "reshard_after_forward, cpu_offload, mixed_precision, batch_size, tp_size)",
    )
    pp.add_argument("--fit-out", default="fit-config.json", help="where --fit writes the config it found")
    pp.add_argument("--json", action="store_true", help="machine-readable output")
    pp.set_defaults(func=cmd_plan)
    pb = sub.add_parser(
        "backends",
        help="list registered backends and whether they can run here",
        description="List the registered backends (entry-point group shardcore.backends) and whether each can "
        "run here, with the reason.",
    )
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
