"""``ckpt_fuzz.py BACKEND OUT EXAMPLES SEED``: the checkpoint fuzz campaign (``fuzz_checkpoints``)
on a sharded tiny Llama, FULL then SHARDED, on every rank. BACKEND is ``fsdp2`` (under torchrun),
``xla-fsdp`` or ``xla-spmd`` (CPU PJRT devices). Each rank writes OUT/<format>.rank<r>.json: its
records of every mutated checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BACKEND, OUT, EXAMPLES, SEED = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if BACKEND.startswith("xla"):
    import xla_common  # noqa: F401  (torch_xla first: see shared/xla-notes.md)

from fuzz_checkpoints import Campaign, dcp_oracle, safetensors_oracle, xla_shards_oracle  # noqa: E402

import shardcore  # noqa: E402


def build(kind: str):
    if BACKEND == "fsdp2":
        from ckpt_common import sharded

        model, opt = sharded(config={"state_dict_type": kind})
        return model, opt, shardcore.handle(model).backend
    from xla_common import sharded_llama

    model, backend = sharded_llama(BACKEND.removeprefix("xla-"), state_dict_type=kind)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), backend


def scenario(_rank: int = 0) -> None:
    """``_rank``: where the device threads give it; every rank learns its own from the backend."""
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        model, opt, backend = build(kind)
        if BACKEND == "fsdp2":
            from ckpt_common import train

            train(model, opt, 0, 1)
        else:
            from xla_common import train

            train(model, backend, 1, opt=opt)
        work = OUT / kind
        pristine = shardcore.save(model, work / "pristine", opt)
        shapes = backend.full_state_dict(model)
        if kind == "FULL_STATE_DICT":
            oracle = safetensors_oracle
        elif BACKEND == "xla-fsdp":
            oracle = xla_shards_oracle
        else:
            oracle = lambda p: dcp_oracle(p, shapes)  # noqa: E731
        campaign = Campaign(
            pristine=pristine,
            work=work,
            ranks=backend,
            full_state=lambda: {k: v.detach().cpu().clone() for k, v in backend.full_state_dict(model).items()},
            load=lambda p: shardcore.load(model, p, opt),
            oracle=oracle,
            aliases=shardcore.checkpoint.tied_names(model),
        )
        records = campaign.run(EXAMPLES, SEED)
        (OUT / f"{kind}.rank{backend.world().rank}.json").write_text(json.dumps(records))
        backend.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if BACKEND == "fsdp2":
        from ckpt_common import run

        run(scenario)
    else:
        from xla_common import on_devices

        on_devices(BACKEND.removeprefix("xla-"), scenario)
