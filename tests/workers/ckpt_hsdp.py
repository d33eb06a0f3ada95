"""``ckpt_hsdp.py DIR`` (4 ranks): resume through HSDP layouts, both formats; rank 0 writes
DIR/hsdp_chain.pt."""

import sys
from pathlib import Path

import torch

import shardcore

from ckpt_common import STEPS, backend, full, run, sharded, train, write

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


if __name__ == "__main__":
    run(hsdp_chain, Path(sys.argv[1]))
