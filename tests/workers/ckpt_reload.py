"""``ckpt_reload.py SRC OUT [SAVE_TO]``: load the SHARDED (or FULL) checkpoint SRC, with its
optimizer state, into a model of other initial weights on this world (1 rank: a 2-rank checkpoint
resharded 2 -> 1, or one whose replacement was killed mid-save); rank 0 writes ``{"state": full
state}`` to OUT; with SAVE_TO, save SHARDED there again (for 1 -> 2)."""

import sys
from pathlib import Path

import shardcore

from ckpt_common import full, run, sharded, write


def reload(src: Path, out: Path, save_to: Path | None) -> None:
    model, opt = sharded(seed=5)
    shardcore.load(model, src, opt)
    write(out.parent, out.name, {"state": full(model)})
    if save_to is not None:
        shardcore.save(model, save_to, opt, state_dict_type="SHARDED_STATE_DICT")


if __name__ == "__main__":
    src, out, *save_to = map(Path, sys.argv[1:])
    run(reload, src, out, save_to[0] if save_to else None)
