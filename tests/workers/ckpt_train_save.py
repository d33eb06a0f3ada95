"""``ckpt_train_save.py DIR`` (2 ranks): 3 steps, save FULL and SHARDED (with optimizer), 3 more
steps: the straight 6-step run the resumes are compared with; then, inside the ranks, a checkpoint
of another model gives every rank the same clear error and nobody hangs (``errors.ok`` when all did).
DIR holds ``single`` and ``hf_single`` (saved by the test) for later runs.
"""

import sys
from pathlib import Path

import shardcore

from ckpt_common import expect_error, full, logits, run, sharded, train, write


def train_save(d: Path) -> None:
    model, opt = sharded()
    losses = train(model, opt, 0, 3)
    shardcore.save(model, d / "full3", opt)  # the config's default: FULL_STATE_DICT
    shardcore.save(model, d / "sharded3", opt, state_dict_type="SHARDED_STATE_DICT")
    write(d, "step3.pt", {"logits": logits(model), "state": full(model)})
    losses += train(model, opt, 3, 6)
    write(d, "straight.pt", {"losses": losses, "state": full(model)})

    # a checkpoint of another model: every rank raises the same clear error, nobody hangs
    other, _ = sharded(hidden_size=48, intermediate_size=56)
    expect_error(lambda: shardcore.load(other, d / "full3"), "another model", "shape", "model.embed_tokens.weight")
    expect_error(lambda: shardcore.load(other, d / "sharded3"), "another model", "shape")
    deeper, _ = sharded(num_hidden_layers=3)
    expect_error(lambda: shardcore.load(deeper, d / "full3"), "missing", "model.layers.2.")
    expect_error(lambda: shardcore.load(deeper, d / "sharded3"), "missing", "model.layers.2.")
    shallower, _ = sharded(num_hidden_layers=1)
    expect_error(lambda: shardcore.load(shallower, d / "full3"), "unexpected", "model.layers.1.")
    expect_error(lambda: shardcore.load(model, d / "step3.pt"), "not a checkpoint")
    write(d, "errors.ok", True)


if __name__ == "__main__":
    run(train_save, Path(sys.argv[1]))
