"""``python xla_recycled.py BACKEND...``: for each backend (``xla``, or ``module:Class``), on one
device, whether a unit output whose id CPython recycled from a dead, hooked output still gets XLA
FSDP's pre-backward hook. Prints ``{BACKEND: {...}, ...}``.

On one thread the allocator seldom recycles an id there (device threads interleave their
allocations, and then it happens); here the collision is made: a hooked output is dropped and
tensors are made until one takes its address.
"""

import json
import sys

import torch
import torch_xla

import shardcore
from shardcore_conformance.models import build_model, loss_fn, make_batches

from xla_common import train


def recycled_id(backend_name: str) -> dict:
    cfg = {"xla": True, "transformer_layer_cls_to_wrap": ["LlamaAttention", "Embedding"]}
    model = shardcore.shard(build_model("llama", 0), cfg, backend=backend_name)
    backend = shardcore.handle(model).backend
    train(model, backend, 1)  # the root's lazy init sets up the shared set of hooked output ids
    loss = loss_fn("llama", model, backend.local_batch(next(iter(make_batches("llama", 1, 8, 0)))))
    base = torch.ones(3, device=torch_xla.device(), requires_grad=True)
    first, dropped = base * 2, base * 3
    unit = model.model.layers[0].self_attn
    unit._register_pre_backward_hooks((first, dropped))  # a unit returning two outputs hooks both
    stale, hooked_before = id(dropped), bool(dropped._backward_hooks)
    del dropped
    made = []
    while len(made) < 100_000 and id(made[-1] if made else None) != stale:
        made.append(base * 4)
    second = made[-1]
    unit._register_pre_backward_hooks((base * 5, second))
    # a unit's first output is hooked without asking the set; if its id is recycled too, the set
    # must still know it, so that an outer unit returning it again does not hook it twice
    dropped = base * 3
    unit._register_pre_backward_hooks((base * 2, dropped))
    stale_again = id(dropped)
    del dropped
    made = []
    while len(made) < 100_000 and id(made[-1] if made else None) != stale_again:
        made.append(base * 4)
    first = made[-1]
    unit._register_pre_backward_hooks((first,))
    root = model
    root._register_pre_backward_hooks((base * 8, first))
    loss.backward()  # ends the step: XLA FSDP clears the set
    return {
        "collided": id(second) == stale and id(first) == stale_again,
        "hooked_before": hooked_before,
        "hooked": bool(second._backward_hooks),
        "hooks_on_returned_twice": len(first._backward_hooks),
    }


if __name__ == "__main__":
    print(json.dumps({name: recycled_id(name) for name in sys.argv[1:]}), flush=True)
