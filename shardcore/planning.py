"""``shardcore plan``: each rank's peak memory before launch, and a config that fits.

**FSDP2: one real step, on nothing.** The model is built under ``FakeTensorMode`` (tensors with
shapes and dtypes, no storage), sharded by ``shardcore.shard`` as it would be on the rank that holds
the largest shards (rank 0: FSDP2 cuts dim 0 in chunks of ``ceil(rows / shards)``), in a process
group of the ``fake`` backend that answers every collective without peers, and trained for two
optimizer steps while torch's ``FSDPMemTracker`` (``torch.distributed._tools``) follows every
tensor: sharded and gathered parameters, all-gather and reduce-scatter buffers, gradients,
optimizer state, activations and temporaries. This is torchtitan's method, applied to any
model and config ``shard()`` takes. The first step's peak is before the optimizer state exists;
the second step is the steady state.

The device is the accelerator torch reports, else the CPU. On the CPU one pool holds everything; under
``cpu_offload`` the part that FSDP2 keeps on the host (sharded parameters, their gradients and the
optimizer state) is taken out of the device's peak and reported as ``host_bytes``. On CUDA the
cuBLAS/cuBLASLt workspaces the step's threads hold, which no tensor op shows the tracker but the
allocator counts, are a part of their own (``blas_workspaces``, :mod:`shardcore.workspaces`); the
temporaries CUDA kernels take inside an op, which a fake step's meta kernels do not, are made around
their ops and counted with the others (``temporaries``).

**XLA** compiles the whole step into one program whose memory is known only once compiled on the
device; only the model states are predicted, and the output says which parts are not.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .config import ShardConfig, parse_config
from .errors import ShardConfigError, ShardcoreError
from .validate import data_parallel_shape

#: the parts of a peak, in the order they are printed; each maps from FSDPMemTracker's categories
PARTS = {
    "sharded_params": ("Sharded Param", "Buffer"),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "optimizer_state": ("OptState",),
    "gathered_params": ("Unsharded Param", "All Gather"),
    "activations": ("Activation",),
    "temporaries": ("Temp", "Reduce Scatter", "Inputs"),
}
#: what FSDP2's CPUOffloadPolicy keeps on the host
HOST_PARTS = ("sharded_params", "gradients", "optimizer_state")
OPTIMIZERS = ("adamw", "sgd")


@dataclass
class Plan:
    """A prediction for the largest rank. ``None`` marks a part that was not computed."""

    backend: str
    world_size: int
    dp_replicate_size: int
    dp_shard_size: int
    batch_size: int
    seq_len: int
    optimizer: str
    device: str
    config: dict[str, Any]
    peak_bytes: int | None
    first_step_peak_bytes: int | None
    breakdown: dict[str, int | None]
    first_step_breakdown: dict[str, int | None]
    host_bytes: int | None = None
    not_predicted: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------- inputs


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80 GB``, ``81920MiB``, ``1.5TiB``, or a plain number of bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ShardcoreError(
            f"shardcore plan --device-memory: cannot read {text!r} as an amount of memory. Write a number with "
            "a unit, e.g. 80GiB, 80GB or 81920MiB (GiB = 2^30 bytes, GB = 10^9)."
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def format_bytes(n: float | None, digits: int = 2) -> str:
    """``n`` bytes in binary units (``None``: a part that was not predicted)."""
    if n is None:
        return "not predicted"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.{digits}f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.{digits}f} TiB"  # pragma: no cover


def _check_sizes(world_size: int, batch_size: int, seq_len: int, global_batch: int | None) -> None:
    for flag, v in (("--world-size", world_size), ("--batch-size", batch_size), ("--seq-len", seq_len)):
        if v < 1:
            raise ShardcoreError(f"shardcore plan {flag}: must be a positive integer, got {v}.")
    if global_batch is not None and global_batch % (world_size * batch_size):
        raise ShardcoreError(
            f"shardcore plan --global-batch-size {global_batch}: not divisible by --world-size {world_size} x "
            f"--batch-size {batch_size} = {world_size * batch_size}, so it cannot be split into micro-batches of "
            f"{batch_size} rows per rank. Use a global batch that is a multiple of {world_size * batch_size}."
        )


# ---------------------------------------------------------------------------------- prediction


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` in a ``fake`` process group (collectives answer
    without peers)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ShardcoreError(
            "shardcore plan: this process already has a process group; plan from its own process (the "
            "shardcore plan command), not from inside a training run."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _vocab(model: nn.Module) -> int:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or not hasattr(model, "forward"):
        raise ShardcoreError(
            f"shardcore plan: {type(model).__name__} is not a causal language model (no config.vocab_size); "
            "plan predicts the training step forward(input_ids, labels).loss of a Hugging Face causal LM."
        )
    return vocab


def peak_tracker(model: nn.Module, optimizer: torch.optim.Optimizer, host: tuple[str, ...] = ()) -> Any:
    """torch's ``FSDPMemTracker`` keeping only the whole rank's peak. Upstream also refreshes every
    module's own peak after every op, walking the stats of all modules each time: O(ops x modules),
    40% of a Llama-3-70B plan, for per-module figures the plan does not use. The global peak is the
    same (``tests/test_planning.py`` compares the two).

    ``host``: parts (of :data:`PARTS`) that live on the host (``cpu_offload`` planned on the CPU): the
    peak is then that of the rest, the device's share, at its own moment; ``host_peak`` is the most
    the host parts held at any moment."""
    from copy import deepcopy

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    excluded = {c for part in host for c in PARTS[part]}

    class PeakTracker(FSDPMemTracker):
        host_peak = 0

        def __enter__(self) -> "PeakTracker":
            super().__enter__()
            # upstream starts the peak at the whole current total; start it at the device's share
            self._peak_mem, self._peak_mem_snap = {}, {}
            self._update_peak_stats(None)
            return self

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                held = sum(n for k, n in snap.items() if getattr(k, "value", k) in excluded)
                self.host_peak = max(self.host_peak, held)
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY] - held:
                    self._peak_mem[dev] = snap[_TOTAL_KEY] - held
                    self._peak_mem_snap[dev] = deepcopy(snap)

    return PeakTracker(model, optimizer)


def _optimizer(params: list[torch.Tensor], name: str) -> torch.optim.Optimizer:
    """The planned optimizer: ``foreach`` as torch picks it on accelerators (one fused op per step over
    all tensors, whose temporaries count), also on the CPU where torch would loop per tensor."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    return torch.optim.SGD(params, lr=1e-4, foreach=True)


def _parts(snapshot: dict[Any, dict[Any, int]], device: str) -> dict[str, int]:
    by_name: dict[str, int] = {}
    for dev, cats in snapshot.items():
        if str(torch.device(dev).type) != device:
            continue
        for cat, n in cats.items():
            by_name[getattr(cat, "value", str(cat))] = by_name.get(getattr(cat, "value", str(cat)), 0) + int(n)
    return {part: sum(by_name.get(c, 0) for c in cats) for part, cats in PARTS.items()}


@contextlib.contextmanager
def _unpacked_positions() -> Iterator[None]:
    """The planned step's attention as a real run takes it. Without a cache (training, and every
    config with activation checkpointing, which turns ``use_cache`` off) Transformers reads the
    position ids' values to see whether several sequences are packed into a row. Fake tensors have no
    values, so it assumes packing and builds a full (batch, 1, seq, seq) mask: grouped KV heads are
    then repeated instead of passed with ``enable_gqa``, and attention takes another kernel (on CUDA,
    fp32 Llama: memory-efficient, where a real run takes math attention and its score matrices). The
    planned step passes no position ids, so the model's own run 0..seq-1 in every row, which a real
    run finds unpacked."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    found = getattr(masking_utils, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found


def _fsdp2_plan(
    build: Callable[[], nn.Module],
    cfg: ShardConfig,
    world_size: int,
    batch_size: int,
    seq_len: int,
    optimizer: str,
    kernel_scratch: Any = None,
) -> tuple[list[tuple[dict[str, int], int | None]], str, Any]:
    """Per step (first, steady): the largest rank's parts at its peak on ``device``, and None; under
    cpu_offload on the CPU, the device's share at its own peak (host parts 0) and the most the host
    held. Also the device, and on CUDA which of the step's threads ran GEMMs (else None)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import shardcore

    from . import workspaces
    from .devices import accelerator

    device = accelerator() or "cpu"
    host = HOST_PARTS if cfg.cpu_offload and device == "cpu" else ()
    # kernel_scratch: another device's kernel rules, for a plan made here to stand in for that device's
    kernels: Any = workspaces.DeviceKernels(device, kernel_scratch)
    if device != "cuda" and not kernels.scratch:
        kernels = None  # no GEMM workspaces to count, no temporaries to make
    steps: list[tuple[dict[str, int], int | None]] = []
    # Backward on this thread, as AOTAutograd runs it when it traces fake tensors (pytorch#86245: fake
    # tensor mode kept strictly sequential). On an accelerator the autograd engine would hand it, and
    # activation checkpointing's recomputation, to its device thread; no tensor's size depends on the
    # thread, and the workspaces that do are counted per phase (shardcore.workspaces).
    with (
        _fake_world(world_size),
        FakeTensorMode(allow_non_fake_inputs=True),
        _real_meshes(),
        _untracked_shape_propagation(),
        torch.autograd.set_multithreading_enabled(False),
        _unpacked_positions(),
    ):
        # built on the device: torch 2.11's fully_shard does not move fake tensors there (it asserts),
        # and Module.to cannot swap them
        with torch.device(device):
            model = build()
        vocab = _vocab(model)
        model = shardcore.shard(model, cfg, backend="fsdp2")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(params, optimizer)
        where = next(model.parameters()).device
        ids = torch.randint(0, vocab, (batch_size, seq_len), device=where if where.type != "cpu" else "cpu")
        for _ in range(2):
            # a tracker per step: the second one starts from the state the first step left
            # the kernels' mode entered after the tracker: the tracker counts the temporaries it makes
            with peak_tracker(model, opt, host) as tracker, kernels or contextlib.nullcontext():
                tracker.track_inputs((ids,))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                parts = _parts(tracker.get_tracker_snapshot("peak"), device)
                if host:
                    steps.append(({k: (0 if k in host else v) for k, v in parts.items()}, tracker.host_peak))
                else:
                    steps.append((parts, None))
    return steps, device, kernels.threads if kernels else None


@contextlib.contextmanager
def _real_meshes() -> Iterator[None]:
    """Device meshes built out of fake mode. A mesh is a small tensor of ranks, and torch 2.13's
    ``DeviceMesh`` finds this rank's coordinates in it with ``nonzero``, whose output shape a fake
    tensor cannot know (``DynamicOutputShapeException``): FSDP2 builds such a mesh for every
    parameter tensor parallelism split (``DeviceMesh._concatenate``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__

    def real_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


@contextlib.contextmanager
def _untracked_shape_propagation() -> Iterator[None]:
    """DTensor's shape propagation with no mode active, in a fake mode of its own, as torch 2.9 runs it.
    torch 2.13 runs each op it has not seen yet under the ambient fake mode (``detect_fake_mode``),
    in sight of the memory tracker: the first plan with ``tp_size`` in a process counted those
    global-shape outputs (1.09 MB more first-step peak on the test model) and later plans, served from
    its cache, did not. They are shapes, not memory a rank holds."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    name = "_propagate_tensor_meta_non_cached"
    inner = getattr(ShardingPropagator, name)

    def outside(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return inner(self, *args, **kwargs)

    setattr(ShardingPropagator, name, outside)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, inner)


def _add_workspaces(plan: Plan, threads: Any) -> None:
    """The BLAS workspaces the device holds outside any tensor (``shardcore.workspaces``), as a part of
    both peaks where modelled; on other accelerators the output says they are not predicted."""
    from . import workspaces

    if plan.device == "cpu":
        return
    why = workspaces.modelled(plan.device)
    if why is not None:
        plan.not_predicted["blas_workspaces"] = why
        return
    n = workspaces.workspace_bytes(threads, torch.cuda.get_device_capability(torch.cuda.current_device()))
    for breakdown in (plan.breakdown, plan.first_step_breakdown):
        breakdown["blas_workspaces"] = n
    plan.peak_bytes += n
    plan.first_step_peak_bytes += n


def predict(
    build: Callable[[], nn.Module],
    config: Any,
    world_size: int,
    batch_size: int,
    seq_len: int,
    optimizer: str = "adamw",
    global_batch: int | None = None,
) -> Plan:
    """Predict the largest rank's peak memory for ``config`` at ``world_size``, per-rank micro-batch
    ``batch_size`` x ``seq_len`` tokens. ``build()`` returns the model (called under
    ``FakeTensorMode``: no memory is allocated)."""
    t0 = time.time()
    cfg = parse_config(config)
    _check_sizes(world_size, batch_size, seq_len, global_batch)
    if optimizer not in OPTIMIZERS:
        raise ShardcoreError(f"shardcore plan --optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}.")
    replicas, shards = data_parallel_shape(cfg, world_size)
    base = dict(
        backend=cfg.backend_name,
        world_size=world_size,
        dp_replicate_size=replicas,
        dp_shard_size=shards,
        batch_size=batch_size,
        seq_len=seq_len,
        optimizer=optimizer,
        config=_planned(cfg).to_dict(),
    )
    if cfg.backend_name == "xla":
        return _xla_plan(build, cfg, shards, optimizer, base, t0)
    if cfg.backend_name != "fsdp2":
        raise ShardcoreError(
            f"shardcore plan: backend {cfg.backend_name!r} is not planned; plan knows fsdp2 (every part) and xla "
            "(model states)."
        )
    # one pool on the CPU: what cpu_offload keeps on the host is counted apart from the device's share
    ((first, _), (steady, host)), device, gemm_threads = _fsdp2_plan(
        build, _planned(cfg), world_size, batch_size, seq_len, optimizer
    )
    plan = Plan(
        **base,
        device=device,
        peak_bytes=sum(steady.values()),
        first_step_peak_bytes=sum(first.values()),
        breakdown=steady,
        first_step_breakdown=first,
        host_bytes=host,
    )
    _add_workspaces(plan, gemm_threads)
    if cfg.torch_compile:
        plan.not_predicted["torch_compile"] = "planned as eager: compiled units usually hold fewer activations"
    plan.seconds = time.time() - t0
    return plan


def _planned(cfg: ShardConfig) -> ShardConfig:
    """The config as planned: compilation off (the step is traced eagerly under fake tensors) and
    weights from the model (where they come from does not change the step)."""
    return (
        cfg.replace(torch_compile=False, cpu_ram_efficient_loading=False)
        if cfg.torch_compile or cfg.cpu_ram_efficient_loading
        else cfg
    )


def _xla_plan(
    build: Callable[[], nn.Module], cfg: ShardConfig, shards: int, optimizer: str, base: dict, t0: float
) -> Plan:
    """XLA: the model states per device; the step's memory is the compiled program's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .tp import build_tp_plan

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build()
    tp = build_tp_plan(model, cfg)
    split = tp.split_dims() if tp is not None else {}
    seen: set[int] = set()
    params = grads = state = 0
    per_elem_state = {"adamw": 8, "sgd": 0}[optimizer]
    # XLA FSDP flattens each tensor and pads it to 128 x the devices
    multiple = 128 * shards if not cfg.xla_fsdp_v2 else None
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if multiple:  # XLA FSDP: flattened, padded, then split evenly
            local = -(-n // multiple) * multiple // shards
        elif p.dim():
            local = _spmd_local_numel(tuple(p.shape), shards, cfg.tp_size, split.get(name))
        else:
            local = n
        params += local * p.element_size()
        if p.requires_grad:
            grads += local * p.element_size()
            state += local * per_elem_state
    why = (
        "XLA compiles the whole step into one program; its memory is known once compiled on the device "
        "(torch_xla's memory info), which shardcore plan does not do"
    )
    return Plan(
        **base,
        device="xla",
        peak_bytes=None,
        first_step_peak_bytes=None,
        breakdown={
            "sharded_params": params,
            "gradients": grads,
            "optimizer_state": state,
            "gathered_params": None,
            "activations": None,
            "temporaries": None,
        },
        first_step_breakdown={},
        not_predicted={k: why for k in ("gathered_params", "activations", "temporaries", "peak_bytes")},
        seconds=time.time() - t0,
    )


def _spmd_local_numel(shape: tuple[int, ...], shards: int, tp: int, split: int | None) -> int:
    """One device's elements of a parameter under SPMD: FSDPv2 cuts its largest dim over ``fsdp`` in
    chunks of ceil(size / shards); a weight tensor parallelism splits (dim ``split``) is cut there over
    ``tensor`` and on its largest other dim over ``fsdp`` (a vector: over both, tensor first)
    (shardcore_xla.spmd.tp_spec)."""
    parts = [1] * len(shape)
    if split is None:
        parts[shape.index(max(shape))] = shards
    else:
        parts[split] = tp
        rest = [i for i in range(len(shape)) if i != split]
        parts[max(rest, key=lambda i: shape[i]) if rest else split] *= shards
    return math.prod(math.ceil(n / k) for n, k in zip(shape, parts))


# ---------------------------------------------------------------------------------- fit

#: the knobs --fit may change, and each one's memory-saving setting
KNOBS = ("activation_checkpointing", "reshard_after_forward", "cpu_offload", "mixed_precision", "batch_size", "tp_size")


@dataclass
class Fit:
    fits: bool
    config: dict[str, Any] | None
    batch_size: int | None
    plan: Plan | None
    tried: list[dict[str, Any]]
    smallest_world_size: int | None = None


def _rank(changes: dict[str, Any]) -> tuple:
    """Expected speed, best first: no host transfers (cpu_offload), then the smallest tensor-parallel
    group (each TP layer waits on its group's collectives), then no recomputation
    (activation_checkpointing), then the largest micro-batch, then no extra all-gathers
    (reshard_after_forward), then the user's own precision."""
    return (
        changes.get("cpu_offload", False),
        changes.get("tp_size", 1),
        changes.get("activation_checkpointing", False),
    )


def _tp_sizes(build: Callable[[], nn.Module], cfg: ShardConfig, world_size: int) -> list[int]:
    """The ``tp_size`` values above 1 the model's plan takes at ``world_size``: powers of two that
    divide it and every split dim (heads, features, vocabulary), smallest first."""
    from .tp import build_tp_plan

    model, out, t = None, [], 2
    while t <= world_size:
        if world_size % t == 0:
            candidate = cfg.replace(tp_size=t, dp_shard_size=None)
            try:
                data_parallel_shape(candidate, world_size)
                model = model or build()
                build_tp_plan(model, candidate)
            except ShardConfigError:
                pass  # no plan, or a dim t does not divide: neither does any larger t (all powers of two)
            else:
                out.append(t)
                t *= 2
                continue
            break
        t *= 2
    return out


def fit(
    build: Callable[[], nn.Module],
    config: Any,
    world_size: int,
    batch_size: int,
    seq_len: int,
    device_memory: int,
    optimizer: str = "adamw",
    allow: tuple[str, ...] = KNOBS,
    max_world_size: int = 4096,
) -> Fit:
    """The fastest-expected config that fits ``device_memory`` (see :func:`_rank`), searching only
    the ``allow``ed knobs, with the micro-batch no larger than ``batch_size``."""
    cfg = parse_config(config)
    bad = [k for k in allow if k not in KNOBS]
    if bad:
        raise ShardcoreError(
            f"shardcore plan --allow: {', '.join(bad)} cannot be searched; choose from {', '.join(KNOBS)}."
        )
    saving: dict[str, Any] = {}
    if "activation_checkpointing" in allow and not cfg.activation_checkpointing:
        saving["activation_checkpointing"] = True
    if "reshard_after_forward" in allow and not cfg.reshard_after_forward:
        saving["reshard_after_forward"] = True
    if "cpu_offload" in allow and not cfg.cpu_offload:
        saving["cpu_offload"] = True
    if "mixed_precision" in allow and cfg.mixed_precision is None:
        saving["mixed_precision"] = "bf16"
    names = sorted(saving)
    combos = []
    for mask in range(2 ** len(names)):
        combos.append({n: saving[n] for i, n in enumerate(names) if mask >> i & 1})
    if "tp_size" in allow and cfg.tp_size == 1:
        # the data-parallel size follows: every rank outside a tp group shards
        combos += [
            {**c, "tp_size": t, **({"dp_shard_size": None} if cfg.dp_shard_size else {})}
            for t in _tp_sizes(build, cfg, world_size)
            for c in combos
        ]
    combos.sort(key=lambda c: (_rank(c), "reshard_after_forward" in c, "mixed_precision" in c))
    batches = _batch_sizes(batch_size) if "batch_size" in allow else [batch_size]
    tried: list[dict[str, Any]] = []
    best = None
    for group in sorted({_rank(c) for c in combos}):
        found = []
        for changes in [c for c in combos if _rank(c) == group]:
            candidate = cfg.replace(**changes) if changes else cfg
            b = _largest_fitting(
                build, candidate, world_size, batches, seq_len, device_memory, optimizer, tried, changes
            )
            if b is not None:
                found.append((-b[0], "reshard_after_forward" in changes, "mixed_precision" in changes, changes, b))
        if found:
            found.sort(key=lambda f: f[:3])
            _, _, _, changes, (b, plan) = found[0]
            best = Fit(True, (cfg.replace(**changes) if changes else cfg).to_dict(), b, plan, tried)
            break
    if best is not None:
        return best
    # nothing fits here: the smallest world size that would, with every saving allowed at the smallest batch
    thrifty = cfg.replace(**saving) if saving else cfg
    n = world_size * 2
    while n <= max_world_size:
        sized = thrifty.replace(dp_shard_size=None) if thrifty.dp_shard_size else thrifty
        try:
            data_parallel_shape(sized, n)
        except ShardConfigError:
            n *= 2
            continue
        plan = predict(build, sized, n, batches[-1], seq_len, optimizer)
        peak = max(plan.peak_bytes or 0, plan.first_step_peak_bytes or 0)
        tried.append({"world_size": n, "changes": saving, "batch_size": batches[-1], "peak_bytes": peak})
        if plan.peak_bytes is not None and peak <= device_memory:
            return Fit(False, None, None, None, tried, smallest_world_size=n)
        n *= 2
    return Fit(False, None, None, None, tried)


def _batch_sizes(batch_size: int) -> list[int]:
    """``batch_size`` and its halvings down to 1, largest first."""
    out = [batch_size]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


def _largest_fitting(build, cfg, world_size, batches, seq_len, limit, optimizer, tried, changes):
    """The largest of ``batches`` whose steady and first-step peaks fit ``limit`` (peak memory grows
    with the micro-batch, so a binary search over the sorted list), with its plan; None if none fits."""
    lo, hi, best = 0, len(batches) - 1, None  # batches are largest first
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = predict(build, cfg, world_size, batches[mid], seq_len, optimizer)
        peak = max(plan.peak_bytes or 0, plan.first_step_peak_bytes or 0)
        tried.append({"changes": changes, "batch_size": batches[mid], "peak_bytes": peak, "fits": peak <= limit})
        if peak <= limit:
            best, hi = (batches[mid], plan), mid - 1
        else:
            lo = mid + 1
    return best
