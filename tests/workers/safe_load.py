"""A SHARDED checkpoint made malicious, loaded by shardcore (one FSDP2 rank, in a fresh process).

    python safe_load.py metadata DIR MARKER   -> .metadata replaced by a pickle that runs
                                                        `touch MARKER` when unpickled
    python safe_load.py bytes    DIR MARKER   -> an optimizer param_group value whose pickle
                                                        runs `touch MARKER`, stored as a DCP bytes entry

Prints JSON: the error shardcore.load raised (type, message), or null.
"""

import json
import os
import pickle
import sys

os.environ.setdefault("USE_TORCH_XLA", "0")

import torch  # noqa: E402

import shardcore  # noqa: E402
from shardcore_conformance.models import MLP  # noqa: E402


class Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def sharded(seed: int):
    torch.manual_seed(seed)
    model = shardcore.shard(MLP(), {"auto_wrap_policy": "NO_WRAP", "state_dict_type": "SHARDED_STATE_DICT"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 13)).sum().backward()
    opt.step()
    return model, opt


def main(kind: str, path: str, marker: str) -> None:
    model, opt = sharded(0)
    if kind == "bytes":
        opt.param_groups[0]["note"] = Evil(marker)
    shardcore.save(model, path, opt)
    if kind == "metadata":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Evil(marker), f)
    other, other_opt = sharded(1)
    if kind == "bytes":
        other_opt.param_groups[0]["note"] = 0  # the loading run expects the entry, so DCP reads it
    try:
        shardcore.load(other, path, other_opt)
        error = None
    except shardcore.ShardcoreError as e:
        error = {"type": type(e).__name__, "message": str(e)}
    print(json.dumps({"error": error}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
