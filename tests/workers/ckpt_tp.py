"""``ckpt_tp.py DIR`` (4 ranks): resume through tensor-parallel layouts, both formats; rank 0 writes
DIR/tp_chain.pt, and the last FULL checkpoint stays in DIR for ``from_pretrained``."""

import sys
from pathlib import Path

from ckpt_hsdp import optimizer_state

import shardcore

from ckpt_common import STEPS, full, run, sharded, train, write

#: layouts a 4-rank run passes through, resuming each time: 2-D (dp_shard 2 x tp 2), plain FSDP over
#: 4, pure TP over 4, HSDP 2 replicas x tp 2
TP_CHAIN = ({"tp_size": 2}, {}, {"tp_size": 4}, {"tp_size": 2, "dp_replicate_size": 2})
#: the vocabulary split 4 ways, 4 KV heads for 4 tp ranks; embeddings tied
MODEL = {"vocab_size": 96, "num_key_value_heads": 4}


def tp_chain(d: Path) -> None:
    model, opt = sharded(0, {}, **MODEL)
    out = {"straight": train(model, opt, 0, STEPS, "llama_tp")}
    del model, opt
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        runs, previous = [], None
        for i, layout in enumerate(TP_CHAIN):
            model, opt = sharded(0 if previous is None else 100 + i, layout, **MODEL)
            loaded = None
            if previous is not None:
                shardcore.load(model, previous, opt)
                loaded = {"params": full(model), "optim": optimizer_state(model, opt)}
            first = (STEPS * i) // len(TP_CHAIN)
            losses = train(model, opt, first, (STEPS * (i + 1)) // len(TP_CHAIN), "llama_tp")
            saved = {"params": full(model), "optim": optimizer_state(model, opt)}
            previous = d / f"tp-{kind}-{i}"
            shardcore.save(model, previous, opt, state_dict_type=kind)
            runs.append({"layout": layout, "loaded": loaded, "saved": saved, "losses": losses})
            del model, opt
        out[kind] = runs
    write(d, "tp_chain.pt", out)


if __name__ == "__main__":
    run(tp_chain, Path(sys.argv[1]))
