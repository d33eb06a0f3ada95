"""``python xla_full_checkpoint.py MODE DIR FSDP2_CKPT``: FULL checkpoints across backends, both
ways, in one process. Trains 3 steps and saves FULL to DIR/ckpt, with the full state it saved in
DIR/expected.safetensors (for FSDP2 and plain PyTorch to load); then loads FSDP2_CKPT (saved by
FSDP2) into a new sharded model and writes its full state to DIR/got.safetensors."""

import sys

import shardcore

from xla_common import on_devices, save_full, sharded_llama, train


def scenario(mode: str, out: str, fsdp2_ckpt: str, rank: int) -> None:
    model, backend = sharded_llama(mode)
    train(model, backend, 3)
    shardcore.save(model, f"{out}/ckpt")
    save_full(backend, model, f"{out}/expected.safetensors", rank)
    del model, backend
    model, backend = sharded_llama(mode)
    shardcore.load(model, fsdp2_ckpt)
    save_full(backend, model, f"{out}/got.safetensors", rank)


if __name__ == "__main__":
    mode, out, fsdp2_ckpt = sys.argv[1:4]
    on_devices(mode, scenario, mode, out, fsdp2_ckpt)
