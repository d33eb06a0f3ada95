"""One step's gradients of the conformance models, computed eagerly on the CPU and on one XLA:CPU
device, saved to ``argv[1]``. tests/test_numerics.py runs it under two CPU ISA settings and compares
every pair: the rounding difference between correct implementations that the tolerances rest on."""

import sys

import torch
import torch_xla  # noqa: F401  (initialise XLA before any CPU backward: see shared/xla-notes.md)

from shardcore.ties import ties_kept
from shardcore_conformance.models import build_model, loss_fn, make_batches

MODELS = ("gpt2", "llama", "mlp")


def gradients(model_name: str, device) -> dict[str, torch.Tensor]:
    model = build_model(model_name, 0)
    with ties_kept(model):  # model.to(xla) gives each holder of a tied weight its own copy
        model.to(device)
    batch = {k: v.to(device) for k, v in next(iter(make_batches(model_name, 1, 4, 0))).items()}
    loss_fn(model_name, model, batch).backward()
    if device.type == "xla":
        torch_xla.sync()
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    torch.use_deterministic_algorithms(True)
    out = {}
    # XLA's backward first: an eager CPU backward before XLA's device is registered breaks every later
    # XLA backward (autograd's device_ready_queues_ assert; shared/xla-notes.md)
    for name in MODELS:
        out[f"{name}/xla"] = gradients(name, torch_xla.device())
    for name in MODELS:
        out[f"{name}/eager"] = gradients(name, torch.device("cpu"))
    torch.save(out, sys.argv[1])


if __name__ == "__main__":
    main()
