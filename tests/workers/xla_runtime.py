"""``python xla_runtime.py MODE``: the runtime family on one (mode, device count), in one process.

First (so that nothing compiled the step before) 6 training steps, recording XLA's compile count
after each; then one training step per grad-ckpt setting, counting the forward calls of a unit's
MLP (xla_fsdp_grad_ckpt runs it again in backward). Between them, the trained model's FULL state
dict and optimizer state, gathered twice: how many programs that compiled (torch_xla's own
``CompileTime`` samples, which count the replicating programs ``.cpu()`` of a sharded tensor
compiles outside the graph cache), and whether they equal what ``.cpu()`` gathers. Rank 0 prints
``{"compiles": [...], "forwards": {"0": n, "1": n}, "gather_compiles": n, "gathered_as_cpu": bool}``.
"""

import sys

import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs

from shardcore_xla.spmd import to_host
from shardcore_xla.state_dict import param_layout, strip_wrappers

from xla_common import emitter, on_devices, sharded_llama, train


def compilations() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def gather(mode: str, model, backend, opt) -> tuple[int, bool]:
    before = compilations()
    for _ in range(2):
        sd = backend.full_state_dict(model)
        osd = backend.full_optimizer_state_dict(model, opt)
    compiled = compilations() - before
    if mode != "spmd":
        return compiled, True
    # torch_xla's own gather of each sharded tensor: the values the shards must add up to
    want = {strip_wrappers(k): v.cpu() for k, v in model.state_dict().items()}
    same = set(want) <= set(sd) and all(torch.equal(sd[k], want[k]) for k in want)
    layout = param_layout(model)
    for p, st in opt.state.items():
        same = same and torch.equal(osd["state"][layout[id(p)][0][0]]["exp_avg"], st["exp_avg"].cpu())
    return compiled, same and uneven_shards_gather_as_cpu()


def uneven_shards_gather_as_cpu() -> bool:
    """Dims the devices do not divide (zero-padded shards), split on dim 0 or 1, and a value still
    being computed."""
    mesh = xs.Mesh(np.arange(2), (2, 1), ("fsdp", "model"))
    cases = [((5, 3), ("fsdp", None)), ((7,), ("fsdp",)), ((3, 5), (None, "fsdp")), ((2, 3), (None, None))]
    tensors = []
    for shape, spec in cases:
        t = torch.arange(float(np.prod(shape))).view(shape).to(torch_xla.device())
        xs.mark_sharding(t, mesh, spec)
        tensors.append(t)
    torch_xla.sync()
    tensors.append(tensors[0] * 2)
    got = to_host(tensors)
    return all(torch.equal(g, t.cpu()) for g, t in zip(got, tensors))


def scenario(mode: str, rank: int) -> None:
    model, backend = sharded_llama(mode)
    counts = []
    opt = train(model, backend, 6, lambda i: counts.append(backend.compile_count()))
    gather_compiles, gathered_as_cpu = gather(mode, model, backend, opt)
    del model, backend, opt
    forwards = {}
    for gc in ("0", "1"):
        calls = []
        model, backend = sharded_llama(mode, gc == "1", lambda *a: calls.append(1))
        train(model, backend, 1)
        forwards[gc] = len(calls)
    # every device, not only the one that reports: its unit ran once, and again in backward with gc
    assert forwards == {"0": 1, "1": 2}, (rank, forwards)
    emitter(rank)(
        {
            "compiles": counts,
            "forwards": forwards,
            "gather_compiles": gather_compiles,
            "gathered_as_cpu": gathered_as_cpu,
        }
    )


if __name__ == "__main__":
    mode = sys.argv[1]
    on_devices(mode, scenario, mode)
