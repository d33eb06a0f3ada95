"""``python xla_resume.py MODE FORMAT IN OUT``: loads IN (a checkpoint; "-": none) into a sharded
tiny Llama and AdamW, dumps both to OUT/loaded.safetensors, trains 2 steps, saves FORMAT to
OUT/ckpt and dumps the state it saved to OUT/saved.safetensors. A load that fails raises (the test
reads the error from stderr)."""

import sys

import torch

import shardcore

from xla_common import dump, llama, on_devices, sharded_llama, train


def scenario(mode: str, kind: str, src: str, out: str, rank: int) -> None:
    model, backend = sharded_llama(mode, state_dict_type=kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if src != "-":
        shardcore.load(model, src, opt)
    dump(backend, model, opt, f"{out}/loaded.safetensors", rank)
    train(model, backend, 2, opt=opt, name=llama(mode))
    shardcore.save(model, f"{out}/ckpt", opt)
    dump(backend, model, opt, f"{out}/saved.safetensors", rank)


if __name__ == "__main__":
    mode, kind, src, out = sys.argv[1:5]
    on_devices(mode, scenario, mode, kind, src, out)
