"""``python xla_sliced.py MODE DIR``: sliced loading of a FULL checkpoint, in one process. Trains 2
steps and saves FULL with AdamW state to DIR/ckpt; then loads it with shardcore.load (the sliced
path) and through the rank-0 path, and prints JSON of the mismatches between the two and of the
elements each rank read (a whole-file read raises)."""

import sys

import safetensors.torch
import torch
import torch_xla.runtime as xr

import shardcore
import shardcore.checkpoint as ckpt

from xla_common import emitter, on_devices, sharded_llama, train

_SLICE_READS: dict[int, int] = {}


def save(mode: str, out: str) -> None:
    model, backend = sharded_llama(mode, state_dict_type="FULL_STATE_DICT")
    opt = train(model, backend, 2)
    shardcore.save(model, out, opt)


def sliced(mode: str, src: str, rank: int) -> dict:
    """The sliced path of shardcore.load against the rank-0 path, on the same checkpoint."""
    want, backend = sharded_llama(mode)
    want_opt = torch.optim.AdamW(want.parameters(), lr=1e-2)
    files = ckpt.full.weight_files(ckpt.atomic.resolve_checkpoint(src))
    backend.load_full_state_dict(want, ckpt.full.read_weights(files, backend.tied_aliases(want)) if rank == 0 else {})
    osd = ckpt.full.read_optimizer(*ckpt.full.optimizer_files(files[0].parent, want_opt)) if rank == 0 else {}
    backend.load_full_optimizer_state_dict(want, want_opt, osd)

    fill = ckpt.full.SliceReader.fill

    def counting(self, name, index, out):
        me = 0 if mode == "spmd" else xr.global_ordinal()
        _SLICE_READS[me] = _SLICE_READS.get(me, 0) + out.numel()
        return fill(self, name, index, out)

    def whole_file(*a, **k):
        raise AssertionError("a whole safetensors file was read on the sliced path")

    got, _ = sharded_llama(mode)
    opt = torch.optim.AdamW(got.parameters(), lr=1e-2)
    real = safetensors.torch.load_file
    # device threads share the module attributes: patch once, while no thread is reading
    backend.barrier()
    if rank == 0:
        ckpt.full.SliceReader.fill, safetensors.torch.load_file = counting, whole_file
    backend.barrier()
    shardcore.load(got, src, opt)
    backend.barrier()
    if rank == 0:
        ckpt.full.SliceReader.fill, safetensors.torch.load_file = fill, real
    differs = [
        i for i, (a, b) in enumerate(zip(want.parameters(), got.parameters())) if not torch.equal(a.cpu(), b.cpu())
    ]
    for a, b in zip(want.parameters(), got.parameters()):
        sa, sb = want_opt.state[a], opt.state[b]
        if sorted(sa) != sorted(sb) or any(
            not torch.equal(torch.as_tensor(sa[k]).cpu(), torch.as_tensor(sb[k]).cpu()) for k in sa
        ):
            differs.append(f"optimizer {sorted(sa)} vs {sorted(sb)}")
    bad = backend.all_reduce_sum(torch.tensor(float(len(differs))).to(backend.world().device)).cpu()
    backend.barrier()
    assert not differs, (rank, differs)  # which parameters differ, on the device they differ on
    weights = real(str(files[0]))
    state = real(str(files[0].parent / ckpt.OPTIMIZER_TENSORS))
    return {
        "differs": float(bad),
        "reads": [_SLICE_READS.get(r, 0) for r in range(backend.world().size)],
        "weight_elements": sum(t.numel() for t in weights.values()),
        "state_elements": sum(t.numel() for t in state.values() if t.dim()),
        "state_scalars": sum(1 for t in state.values() if not t.dim()),
        "optimizer_entries": sum(len(st) for st in opt.state.values()),
    }


def scenario(mode: str, d: str, rank: int) -> None:
    save(mode, f"{d}/ckpt")
    emitter(rank)(sliced(mode, f"{d}/ckpt", rank))


if __name__ == "__main__":
    mode, d = sys.argv[1:3]
    on_devices(mode, scenario, mode, d)
