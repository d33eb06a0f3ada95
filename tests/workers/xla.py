"""XLA runs for tests/test_xla.py, each in its own process (PJRT settings are per process).

    python xla.py compile  MODE STEPS           -> JSON: compile count after each step
    python xla.py save     MODE DIR             -> trains 3 steps, shardcore.save FULL to DIR/ckpt,
                                                          full_state_dict to DIR/expected.safetensors
    python xla.py load     MODE CKPT OUT        -> shardcore.load CKPT into a sharded model,
                                                          full_state_dict to OUT
    python xla.py forwards MODE GC              -> JSON: forward calls of a unit's MLP in one step
    python xla.py resume   MODE FORMAT IN OUT   -> loads IN (a checkpoint; "-": none) into a sharded
                                                          model and AdamW, dumps both to OUT/loaded.safetensors,
                                                          trains 2 steps, saves FORMAT to OUT/ckpt and dumps
                                                          the state saved to OUT/saved.safetensors
    python xla.py efficient MODE HF_DIR         -> shardcore.from_pretrained with cpu_ram_efficient_loading:
                                                          JSON of which ranks read the files, the largest
                                                          parameter and buffer differences from the files
    python xla.py garbage  MODE                 -> trains 3 steps in which every device drops a cycle
                                                          holding a lazy tensor, and the cycle collector
                                                          runs after device 0 dropped its cycle, before
                                                          device 1 does: JSON of the losses
    python xla.py fallbacks MODE                -> JSON: the CPU-fallback ops torch_xla has counted
                                                          right after shard(), before any other code ran
    python xla.py recycled MODE BACKEND       -> JSON: whether a unit output that took the id of a
                                                          dead, hooked output gets XLA FSDP's pre-backward
                                                          hook (BACKEND: xla, or module:Class)
    python xla.py spawn    MODE                 -> xmp.spawn straight away (no shardcore launcher):
                                                          prints the error shard() raises, as JSON
    python xla.py sliced   MODE CKPT            -> shardcore.load of a FULL checkpoint with AdamW state, read
                                                          in slices, against the rank-0 path: JSON of the
                                                          mismatches and of each rank's elements read
    python xla.py refusals MODE                 -> shard() with what validate_model refuses, then a
                                                          good config, then an odd batch: JSON of every
                                                          device's errors and the devices apply ran on
MODE is "spmd" (xla_fsdp_v2) or "fsdp" (XlaFullyShardedDataParallel). With "fsdp" and CPU_NUM_DEVICES
> 1 the command runs once per device thread (the backend's run_on_devices, i.e. xmp.spawn) and rank 0
prints.
"""

import functools
import gc
import json
import os
import sys

import torch
import torch_xla  # noqa: F401  (initialise XLA before any CPU backward: see shared/xla-notes.md)
from safetensors.torch import save_file

# here, not in the device threads: Transformers' lazy module loading is not thread-safe
from transformers import LlamaForCausalLM

import shardcore
from shardcore_conformance.models import build_model, loss_fn, make_batches
from shardcore_xla import XLABackend


def sharded_llama(mode: str, grad_ckpt: bool = False, hook=None, **extra):
    cfg = {"xla": True, "xla_fsdp_v2": mode == "spmd", "xla_fsdp_grad_ckpt": grad_ckpt, **extra}
    model = build_model("llama", 0)
    if hook is not None:
        model.model.layers[0].mlp.register_forward_hook(hook)
    model = shardcore.shard(model, cfg)
    return model, shardcore.handle(model).backend


def recycled_id(backend_name: str) -> dict:
    """Whether a unit output whose id CPython recycled from a dead, hooked output still gets XLA
    FSDP's pre-backward hook. On one thread the allocator seldom recycles an id there (device
    threads interleave their allocations, and then it happens); here the collision is made: a
    hooked output is dropped and tensors are made until one takes its address."""
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


def dump(backend, model, opt, path: str, rank: int) -> None:
    """The full model and optimizer state, as one safetensors file (rank 0 writes it)."""
    tensors = {f"model.{k}": v for k, v in backend.full_state_dict(model).items()}
    osd = backend.full_optimizer_state_dict(model, opt)
    for name, st in osd["state"].items():
        tensors.update({f"optimizer.{name}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, path)


def train(model, backend, steps: int, after_step=None, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, batch in enumerate(make_batches("llama", steps, 8, 0)):
        loss = loss_fn("llama", model, backend.local_batch(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        backend.step_end()
        float(loss)  # read the loss every step, as a training loop that logs it does
        if after_step:
            after_step(i)
    return opt


_READS: list[int] = []


class CountingLlama(LlamaForCausalLM):
    """Records the rank of every device thread that reads the weights files."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        import torch_xla.runtime as xr

        _READS.append(xr.global_ordinal())
        return super().from_pretrained(*args, **kwargs)


def efficient(mode: str, hf_dir: str, rank: int, emit) -> None:
    from safetensors.torch import load_file

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
    emit(
        json.dumps(
            {
                "reads": sorted(_READS),
                "param_diff": param_diff,
                "buffer_diff_sum": float(worst[0]),
                "buffers": int(worst[1]),
                "keys": len(want),
            }
        ),
        flush=True,
    )


_SLICE_READS: dict[int, int] = {}


def sliced(mode: str, src: str, rank: int, emit) -> None:
    """The sliced path of shardcore.load against the rank-0 path, on the same checkpoint."""
    import safetensors.torch
    import torch_xla.runtime as xr

    import shardcore.checkpoint as ckpt

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
    weights = real(str(files[0]))
    state = real(str(files[0].parent / ckpt.OPTIMIZER_TENSORS))
    emit(
        json.dumps(
            {
                "differs": float(bad),
                "reads": [_SLICE_READS.get(r, 0) for r in range(backend.world().size)],
                "weight_elements": sum(t.numel() for t in weights.values()),
                "state_elements": sum(t.numel() for t in state.values() if t.dim()),
                "state_scalars": sum(1 for t in state.values() if not t.dim()),
                "optimizer_entries": sum(len(st) for st in opt.state.values()),
            }
        ),
        flush=True,
    )


class RecordsApply(XLABackend):
    """The XLA backend, recording the device of every apply call."""

    name = "xla-records-apply"

    def __init__(self):
        super().__init__()
        self.applied = []

    def apply(self, model, plan, config):
        import torch_xla.runtime as xr

        self.applied.append(xr.global_ordinal())
        return super().apply(model, plan, config)


_RECORDER = RecordsApply()  # one instance for every device thread, as get_backend gives


def refusals(rank: int, emit) -> None:
    x = {"xla": True}
    attempts = {
        "pin_layout": ({**x, "xla_fsdp_settings": {"pin_layout_in_collective_ops": True}}, False),
        "rank0_meta": ({**x, "cpu_ram_efficient_loading": True}, rank == 0),
        "device1_meta": (x, rank == 1),
    }
    seen = {}
    for name, (cfg, meta) in attempts.items():
        model = build_model("mlp", 0)
        try:
            shardcore.shard(model.to("meta") if meta else model, cfg, backend=_RECORDER)
            seen[name] = None
        except shardcore.ShardcoreError as e:
            seen[name] = {"type": type(e).__name__, "key": getattr(e, "key", None), "message": str(e)}
    shardcore.shard(build_model("mlp", 0), x, backend=_RECORDER)
    try:
        _RECORDER.local_batch({"x": torch.zeros(3, 13)})
        batch = None
    except shardcore.ShardcoreError as e:
        batch = type(e).__name__
    everyone = _RECORDER._threads.exchange(rank, {"seen": seen, "batch": batch})  # after every apply
    emit(json.dumps({"ranks": everyone, "applied": sorted(_RECORDER.applied)}), flush=True)


def main() -> None:
    cmd, mode = sys.argv[1], sys.argv[2]
    if cmd == "spawn":
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_shard_and_report, args=(mode,))
        return
    devices = int(os.environ.get("CPU_NUM_DEVICES", "1"))
    if mode == "fsdp" and devices > 1:
        shardcore.get_backend("xla").run_on_devices(functools.partial(run, cmd, mode))
    else:
        run(cmd, mode, 0)


def _shard_and_report(index: int, mode: str) -> None:
    try:
        sharded_llama(mode)
        error = None
    except shardcore.ShardcoreError as e:
        error = {"type": type(e).__name__, "message": str(e)}
    if index == 0:
        print(json.dumps({"error": error}), flush=True)


def run(cmd: str, mode: str, rank: int) -> None:
    emit = print if rank == 0 else (lambda *a, **k: None)
    if cmd == "forwards":
        calls = []
        model, backend = sharded_llama(mode, sys.argv[3] == "1", lambda *a: calls.append(1))
        train(model, backend, 1)
        emit(json.dumps({"forwards": len(calls)}), flush=True)
        return
    if cmd == "efficient":
        efficient(mode, sys.argv[3], rank, emit)
        return
    if cmd == "refusals":
        refusals(rank, emit)
        return
    if cmd == "sliced":
        sliced(mode, sys.argv[3], rank, emit)
        return
    if cmd == "recycled":
        emit(json.dumps(recycled_id(sys.argv[3])), flush=True)
        return
    if cmd == "resume":
        kind, src, out = sys.argv[3:6]
        model, backend = sharded_llama(mode, state_dict_type=kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if src != "-":
            shardcore.load(model, src, opt)
        dump(backend, model, opt, f"{out}/loaded.safetensors", rank)
        train(model, backend, 2, opt=opt)
        shardcore.save(model, f"{out}/ckpt", opt)
        dump(backend, model, opt, f"{out}/saved.safetensors", rank)
        return
    model, backend = sharded_llama(mode)
    if cmd == "fallbacks":
        import torch_xla.debug.metrics as met

        emit(json.dumps({"fallbacks": sorted(met.executed_fallback_ops())}), flush=True)
        return
    if cmd == "garbage":
        threads = backend._threads
        opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
        for batch in make_batches("llama", 3, 8, 0):
            loss = loss_fn("llama", model, backend.local_batch(batch))
            loss.backward()
            opt.step()
            opt.zero_grad()
            # what automatic collection does now and then, made certain: it runs, on any thread,
            # between two devices' drops of an autograd graph or a hook closure
            for turn in range(threads.size):
                if rank == turn:
                    junk = [loss * 2]
                    junk.append(junk)
                    del junk
                    if turn == 0:
                        gc.collect()
                threads.wait()
            backend.step_end()
            losses.append(float(loss))
        emit(json.dumps({"losses": losses}), flush=True)
        return
    if cmd == "compile":
        counts = []
        train(model, backend, int(sys.argv[3]), lambda i: counts.append(backend.compile_count()))
        emit(json.dumps({"compiles": counts}), flush=True)
    elif cmd == "save":
        out = sys.argv[3]
        train(model, backend, 3)
        shardcore.save(model, f"{out}/ckpt")
        full = backend.full_state_dict(model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/expected.safetensors")
    elif cmd == "load":
        shardcore.load(model, sys.argv[3])
        full = backend.full_state_dict(model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, sys.argv[4])
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main()
