"""``python xla_layout.py`` on 4 CPU devices under SPMD: what parity cannot see. Prints the sharding
specs of the batch, the output and a parameter, with the mesh, for HSDP (``dp_replicate_size: 2``)
and for the default 1-D mesh, whether a FULL load kept them, and the key a shape that does not
factor the devices is refused by."""

import json

import torch
import torch_xla

import shardcore
from shardcore_conformance.models import build_model

V2 = {"xla": True, "xla_fsdp_v2": True}
spec = torch_xla._XLAC._get_xla_sharding_spec
out = {}
try:
    shardcore.shard(build_model("mlp", 0), {**V2, "dp_replicate_size": 3})
except shardcore.ShardConfigError as e:
    out["refused"] = e.key
for name, cfg in (("hsdp", {**V2, "dp_replicate_size": 2}), ("default", V2)):
    model = shardcore.shard(build_model("mlp", 0), cfg)
    backend = shardcore.handle(model).backend
    full = {k: v.detach().cpu() for k, v in build_model("mlp", 1).state_dict().items()}
    backend.load_full_state_dict(model, full)
    head = model.module.head.weight
    x = backend.local_batch({"x": torch.randn(8, 13)})["x"]
    y = model(x)
    out[name] = {
        "mesh": [list(backend._mesh.axis_names), list(backend._mesh.mesh_shape)],
        "batch": spec(x),
        "output": spec(y),
        "head": spec(head),
        "loaded": bool(torch.equal(head.cpu(), full["head.weight"])),
    }
print(json.dumps(out))
