"""``python xla_efficient.py MODE HF_DIR``: shardcore.from_pretrained with cpu_ram_efficient_loading.
Prints JSON of which ranks read the files and the largest parameter and buffer differences from
the files (buffers: summed over the devices)."""

import sys

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import shardcore
from shardcore_conformance.models import build_model

from xla_common import emitter, on_devices

_READS: list[int] = []


class CountingLlama(LlamaForCausalLM):
    """Records the rank of every device thread that reads the weights files."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        import torch_xla.runtime as xr

        _READS.append(xr.global_ordinal())
        return super().from_pretrained(*args, **kwargs)


def scenario(mode: str, hf_dir: str, rank: int) -> None:
    cfg = {"xla": True, "xla_fsdp_v2": mode == "spmd", "cpu_ram_efficient_loading": True}
    model = shardcore.from_pretrained(CountingLlama, hf_dir, cfg)
    backend = shardcore.handle(model).backend
    want = load_file(f"{hf_dir}/model.safetensors")
    got = backend.full_state_dict(model)
    param_diff = max(float((got[k] - v).abs().max()) for k, v in want.items())
    plain = dict(build_model("llama", 0).named_buffers())  # inv_freq: computed, in no file
    buffer_diff, buffers = 0.0, 0
    for k, b in model.named_buffers():
        name = k
        for wrapper in ("_fsdp_wrapped_module.", "_fpw_module.", "_orig_module."):
            name = name.replace(wrapper, "")
        if name in plain:
            buffer_diff, buffers = max(buffer_diff, float((b.cpu() - plain[name]).abs().max())), buffers + 1
    worst = backend.all_reduce_sum(torch.tensor([buffer_diff, buffers]).to(backend.world().device)).cpu()
    backend.barrier()
    emitter(rank)(
        {
            "reads": sorted(_READS),
            "param_diff": param_diff,
            "buffer_diff_sum": float(worst[0]),
            "buffers": int(worst[1]),
            "keys": len(want),
        }
    )


if __name__ == "__main__":
    mode, hf_dir = sys.argv[1:3]
    on_devices(mode, scenario, mode, hf_dir)
