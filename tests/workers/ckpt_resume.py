"""``ckpt_resume.py DIR`` (2 new ranks): resume from each format of ``ckpt_train_save.py`` and train
the last 3 steps; load the 1-rank SHARDED checkpoint (1 -> 2) and single-device ones (plain PyTorch,
save_pretrained). Rank 0 writes DIR/resume.pt."""

import sys
from pathlib import Path

import shardcore

from ckpt_common import full, run, sharded, train, write


def resume(d: Path) -> None:
    out = {}
    for name in ("full3", "sharded3"):
        model, opt = sharded(seed=123)  # other initial weights: only the checkpoint can make them equal
        shardcore.load(model, d / name, opt)
        losses = train(model, opt, 3, 6)
        out[name] = {"losses": losses, "state": full(model)}
        del model, opt

    model, opt = sharded(seed=9)
    shardcore.load(model, d / "sharded_w1", opt)
    out["sharded_w1"] = full(model)

    for name in ("single", "hf_single"):  # saved on one device by plain PyTorch / save_pretrained
        model, _ = sharded(seed=11)
        shardcore.load(model, d / name)
        out[name] = full(model)

    write(d, "resume.pt", out)


if __name__ == "__main__":
    run(resume, Path(sys.argv[1]))
