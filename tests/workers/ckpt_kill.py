"""``ckpt_kill.py DIR KIND`` (2 ranks, env SHARDCORE_TEST_CKPT_MARKER): save a KIND checkpoint, train on, start
saving again and, once the data of that save is written, announce it (the marker file names the
temporary directory) and hang until the test kills every process."""

import os
import sys
import time
from pathlib import Path

import shardcore
import shardcore.checkpoint as ckpt

from ckpt_common import full, run, sharded, train, write


def hang_before_commit() -> None:
    """Kill-test hook: after the data of a save is written, announce it and wait to be killed."""
    real = ckpt.manifest.write_manifest

    def slow(tmp, manifest):
        marker = os.environ["SHARDCORE_TEST_CKPT_MARKER"]
        Path(marker).write_text(str(tmp))
        time.sleep(600)
        real(tmp, manifest)

    ckpt.manifest.write_manifest = slow


def kill(d: Path, kind: str) -> None:
    """Save a checkpoint, train on, start saving again and hang there until the test kills us."""
    model, opt = sharded()
    train(model, opt, 0, 1)
    target = d / f"killed_{'full' if kind == 'FULL_STATE_DICT' else 'sharded'}"
    shardcore.save(model, target, opt, state_dict_type=kind)
    write(d, f"{target.name}.expected.pt", full(model))
    train(model, opt, 1, 2)
    hang_before_commit()
    shardcore.save(model, target, opt, state_dict_type=kind)
    raise SystemExit("the save returned, but the test hook should have hung it")


if __name__ == "__main__":
    run(kill, Path(sys.argv[1]), sys.argv[2])
