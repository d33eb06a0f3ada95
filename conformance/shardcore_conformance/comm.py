"""Communication accounting: what each rank's collectives were in each optimizer step, and what
the wrap plan and the config say they must be.

A parity check cannot see a sharding that is numerically right and wasteful: a model sharded as
one unit whatever the plan says, a ``no_sync`` that still reduces every micro-batch, compiled
wrappers that bypass the sharding hooks. Counts and bytes can.

Recording (:class:`CommRecorder`): the sharded worker wraps ``torch.distributed``'s collectives
(``all_gather_into_tensor``, ``all_gather``, ``reduce_scatter_tensor``, ``reduce_scatter``,
``all_reduce``, and newer torch's ``all_gather_single`` and ``reduce_scatter_single``: what FSDP2 and
DDP-style backends call) and counts, while the training step's
forward and backward run (not the suite's own metric reductions), each call and the bytes of the
full-size tensor it moves: the gathered output of an all-gather, the unreduced input of a
reduce-scatter, the tensor of an all-reduce. That is the ZeRO papers' measure, so one step of
ZeRO-3 moves 3x the parameter bytes.

Prediction (:func:`expected_fsdp`), for a backend that declares ``communication_pattern = "fsdp"``
(FSDP2 and its subclasses): per optimizer step of ``A`` micro-batches, for every unit of the plan
that holds parameters (the root too):

- all-gathers: one per micro-batch in forward, and one more in backward when
  ``reshard_after_forward`` is true, the unit is not the root (the root stays gathered from forward to
  backward) and the backward reaches it or the unit that ran after it (FSDP2 prefetches the next
  all-gather of the backward, even for a frozen first layer the backward never enters);
- reduce-scatters: one per optimizer step when the unit has gradients (``no_sync`` holds the other
  micro-batches' gradients unreduced), one per micro-batch without accumulation;
- HSDP (``dp_replicate_size`` > 1): one all-reduce across replicas per reduce-scatter;
- a collective over a group of one rank moves nothing and is not counted: with one rank per shard
  group (pure replication, or a single device) there are no all-gathers and reduce-scatters;
- bytes: the unit's parameters in the all-gather dtype (``mixed_precision.param_dtype``, else their
  own), the gradients that exist in the reduce dtype; the all-reduce moves one shard. Each may
  exceed that by at most the padding of dim 0 to a multiple of the shard count.

XLA FSDP and SPMD are read from the HLO torch_xla lowers the step to, and predicted and checked
as their own patterns (:mod:`.xla_comm`).

Which units the backward reaches and which parameters get a gradient are properties of the model
(frozen layers, unused parameters), read from the single-device reference run
(:func:`autograd_facts`), not from the backend under test.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
#: torch.distributed function -> (kind, the argument holding its full-size tensor)
_WRAPPED = {
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    # newer torch's names (2.13 here), which its FSDP2 calls; the older names delegate to them
    "all_gather_single": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommRecorder:
    """Counts ``torch.distributed`` collectives per step while :meth:`recording`.

    Installed process-wide (the functions of ``torch.distributed`` and of its ``distributed_c10d``
    module are replaced by counting wrappers) and removed by :meth:`uninstall`. A collective that
    calls another (``_all_gather_base`` -> ``all_gather_into_tensor``) counts once.
    """

    def __init__(self, functional: bool = False) -> None:
        self.steps: list[dict[str, dict[str, Any]]] = []
        self._step: dict[str, dict[str, Any]] | None = None
        self._saved: dict[tuple[Any, str], Any] = {}
        self._local = threading.local()
        # tensor parallelism's collectives: DTensor calls torch's functional collectives, which no
        # torch.distributed function sees. A dispatch mode does (only where the case splits tensors:
        # it puts every op through Python)
        self._functional = functional

    _active: "CommRecorder | None" = None

    def install(self) -> "CommRecorder":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if CommRecorder._active is not None:  # a case that raised left its recorder installed
            CommRecorder._active.uninstall()
        CommRecorder._active = self
        for name, spec in _WRAPPED.items():
            original = getattr(c10d, name, None)
            if original is None:  # a name this torch does not have
                continue
            wrapper = self._wrap(original, *spec)
            for mod in (dist, c10d):
                self._saved[(mod, name)] = getattr(mod, name)
                setattr(mod, name, wrapper)
        return self

    def uninstall(self) -> None:
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        self._saved.clear()
        if CommRecorder._active is self:
            CommRecorder._active = None

    def _wrap(self, original: Any, kind: str, tensor_arg: str) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if self._step is not None and depth == 0:
                bound = signature.bind_partial(*args, **kwargs).arguments
                self._note(kind, _nbytes(bound.get(tensor_arg)), _group_size(bound.get("group")))
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        return counted

    def _note(self, kind: str, nbytes: int, group_size: int) -> None:
        if group_size == 1:
            # nothing leaves the rank: torch 2.9's FSDP2 still calls a reduce-scatter over a
            # shard group of one (pure replication, one device), torch 2.11's skips it
            return
        s = self._step[kind]  # type: ignore[index]
        s["count"] += 1
        s["bytes"] += nbytes
        if group_size not in s["group_sizes"]:
            s["group_sizes"].append(group_size)

    def begin_step(self) -> None:
        self._step = None
        self.steps.append(_empty_step())

    def after_backward(self, model: nn.Module) -> None:
        pass

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count the collectives run inside (the current step's forward and backward)."""
        self._step = self.steps[-1]
        try:
            with _functional_collectives(self) if self._functional else contextlib.nullcontext():
                yield
        finally:
            self._step = None


#: torch's functional collective (``torch.ops._c10d_functional``) -> (kind, the full-size tensor's
#: multiple of its input: an all-gather's output is its input times the group)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", False),
    "all_reduce_": ("all_reduce", False),
    "all_gather_into_tensor": ("all_gather", True),
    "all_gather_into_tensor_out": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
}


def _functional_collectives(recorder: CommRecorder) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # modes run before tensor subclasses: let DTensor turn the op into collectives first
            # (as torch's CommDebugMode does), and see those
            if any(t is DTensor for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            if func.namespace == "_c10d_functional" and recorder._step is not None:
                spec = _FUNCTIONAL.get(func._opname)
                if spec is not None:
                    kind, gathered = spec
                    size = _functional_group_size(func, args, kwargs)
                    nbytes = _nbytes(args[0]) * (size if gathered else 1)
                    recorder._note(kind, nbytes, size)
            return func(*args, **kwargs)

    return Mode()


def _functional_group_size(func: Any, args: Any, kwargs: Any) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs)
    if "group_size" in bound:
        return int(bound["group_size"])
    return _resolve_process_group(bound["group_name"]).size()


def _empty_step() -> dict[str, dict[str, Any]]:
    """A step's record per kind. ``groups``: the first replica group of each distinct grouping (the
    HLO recorders: which devices, not only how many)."""
    return {k: {"count": 0, "bytes": 0, "group_sizes": [], "groups": []} for k in KINDS}


def counts_tp_collectives(config: Any) -> bool:
    """Whether the recorder counts TP's collectives: DTensor's functional ones, seen by a dispatch
    mode, under which dynamo compiles nothing. Compiled, they run inside the graphs, uncounted."""
    return config.tp_size > 1 and not config.torch_compile


def recorder_for(runtime: Any, world_size: int, tensor_parallel: bool = False) -> Any:
    """How the suite sees a backend's collectives (``communication_pattern``): XLA FSDP in each rank's
    traced graph, SPMD in the partitioned program (:mod:`.xla_comm`), anything else at
    ``torch.distributed``'s functions."""
    pattern = getattr(runtime, "communication_pattern", None)
    if pattern == "xla_fsdp":
        from .xla_comm import XlaGraphRecorder

        return XlaGraphRecorder(world_size)
    if pattern == "spmd":
        import torch_xla.runtime as xr

        from .xla_comm import SpmdGraphRecorder

        return SpmdGraphRecorder(xr.global_runtime_device_count()).install()
    return CommRecorder(functional=tensor_parallel).install()


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size(group)
    except Exception:  # noqa: BLE001 - a group this rank is not in, or a destroyed one
        return -1


@dataclass(frozen=True)
class UnitFacts:
    """One unit of the plan as the prediction needs it: its parameters' shapes and element sizes,
    whether the backward reached it, and which of its parameters got a gradient."""

    path: str
    params: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, bytes per element)
    in_backward: bool
    with_grad: tuple[str, ...]


def autograd_facts(model: nn.Module, plan: Any, run_step: Any) -> list[dict[str, Any]]:
    """Run one forward and backward (``run_step(model)``) of a copy of the single-device ``model``
    and record, per unit of ``plan``, its parameters, whether the backward reached its outputs and
    which of its parameters got a gradient."""
    import copy

    model = copy.deepcopy(model)
    units = plan.all_units()
    reached: dict[str, bool] = {u.path: u.path == "" for u in units}
    order: list[str] = []  # units in the order their forward finished
    handles = []
    for u in units:
        if u.path == "":
            continue

        def hook(module: nn.Module, args: Any, output: Any, path: str = u.path) -> None:
            if path not in order:
                order.append(path)
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda grads, p=path: reached.__setitem__(p, True), mode="any"
                )

        handles.append(model.get_submodule(u.path).register_forward_hook(hook))
    tp = getattr(plan, "tp", None)
    split: dict[str, dict[str, Any]] = {}  # tensor-parallel module -> its style and activations' bytes
    readers: dict[tuple[str, int], tuple[torch.Tensor, str]] = {}  # (parent, input) -> the first reader
    for name, style in tp.styles if tp is not None else ():

        def record(module: nn.Module, args: Any, output: Any, name: str = name, style: str = style) -> None:
            x, y = _tensors(args)[0], _tensors(output)[0]
            # layers of one parent reading one tensor (q, k, v) share its gradient's sum over the tp ranks
            first = readers.setdefault((name.rpartition(".")[0], id(x)), (x, name))
            split.setdefault(
                name,
                {
                    "name": name,
                    "style": style,
                    "input_of": first[1] if first[0] is x else name,
                    "in_elems": x.numel(),
                    "in_size": x.element_size(),
                    "in_grad": x.requires_grad,
                    "out_elems": y.numel(),
                    "out_size": y.element_size(),
                },
            )

        handles.append(model.get_submodule(name).register_forward_hook(record))
    try:
        run_step(model)
    finally:
        for h in handles:
            h.remove()
    params = dict(model.named_parameters())
    split_dims = tp.split_dims() if tp is not None else {}
    out = []
    for u in units:
        names = [n for n in u.param_names if n in params]
        out.append(
            {
                "path": u.path,
                # tensor parallelism: the dim of each parameter the tp ranks split, and the split
                # modules whose forward is this unit's (so recomputed with it)
                "tp_split": {n: split_dims[n] for n in names if n in split_dims},
                "tp_modules": [f for m, f in split.items() if _owner(m, units) == u.path],
                "params": [[n, list(params[n].shape), params[n].element_size()] for n in names],
                "in_backward": reached[u.path],
                # FSDP2 prefetches, in the backward of a unit, the unit that finished forward just
                # before it, whether or not the backward will reach that one
                "prefetched": u.path in order
                and order.index(u.path) + 1 < len(order)
                and reached[order[order.index(u.path) + 1]],
                "with_grad": [n for n in names if params[n].grad is not None],
            }
        )
    return out


def _owner(module: str, units: Any) -> str:
    """The unit whose forward runs ``module``: the deepest unit above it, else the root."""
    above = [u.path for u in units if u.path and (module == u.path or module.startswith(u.path + "."))]
    return max(above, key=len, default="")


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if hasattr(x, "to_tuple"):  # Hugging Face ModelOutput
        return _tensors(x.to_tuple())
    return []


def itemsize(dtype_name: str | None) -> int | None:
    """Bytes per element of a dtype named as ``ShardConfig`` names them (``"bfloat16"``); None: None."""
    return getattr(torch, dtype_name).itemsize if dtype_name else None


def _empty_expectation() -> dict[str, dict[str, Any]]:
    return {k: {"count": 0, "bytes": [0, 0], "why": []} for k in KINDS}


def _padded(shape: list[int], shards: int) -> tuple[int, int]:
    """Elements of a parameter, and with dim 0 padded to a multiple of ``shards`` (FSDP2's chunks)."""
    n = math.prod(shape)
    if not shape:
        return n, n
    rows = shape[0]
    per_row = n // rows if rows else 0
    return n, -(-rows // shards) * shards * per_row


def expected_fsdp(
    units: list[dict[str, Any]], config: Any, world_size: int, grad_accum: int
) -> dict[str, dict[str, Any]]:
    """Per kind: ``count`` per optimizer step, ``bytes`` ``[lowest, highest]`` per step, and ``why``
    (the rule, for messages). See the module docstring for the rules."""
    from shardcore.validate import data_parallel_shape

    replicas, shards = data_parallel_shape(config, world_size)
    mp = config.mixed_precision
    gather_size = itemsize(mp.param_dtype) if mp is not None else None
    reduce_dtype = (mp.reduce_dtype or mp.param_dtype) if mp is not None else None
    reduce_size = itemsize(reduce_dtype)
    reshard = config.reshard_after_forward
    a = grad_accum
    out = _empty_expectation()

    def add(kind: str, count: int, lo: int, hi: int, why: str) -> None:
        if count:
            out[kind]["count"] += count
            out[kind]["bytes"][0] += count * lo
            out[kind]["bytes"][1] += count * hi
            out[kind]["why"].append(why)

    tp = config.tp_size

    def local(name: str, shape: list[int]) -> list[int]:
        """The part of a parameter one tp rank holds, which FSDP then shards."""
        dim = u.get("tp_split", {}).get(name)
        return shape if dim is None else [d // tp if i == dim else d for i, d in enumerate(shape)]

    for u in units:
        if counts_tp_collectives(config):
            _expect_tensor_parallel(u, config, replicas * shards, a, add)
        if not u["params"]:
            continue
        name = u["path"] or "<root>"
        lo = hi = 0
        for pname, shape, size in u["params"]:
            n, padded = _padded(local(pname, shape), shards)
            lo += n * (gather_size or size)
            hi += padded * (gather_size or size)
        again = reshard and u["path"] != "" and (u["in_backward"] or u.get("prefetched", False))
        if shards > 1:  # a shard group of one rank holds whole parameters: nothing to gather
            add("all_gather", a * (2 if again else 1), lo, hi, f"{name} x{a * (2 if again else 1)}")
        if u["with_grad"]:
            grads = {n for n in u["with_grad"]}
            rlo = rhi = 0
            for n, shape, size in u["params"]:
                if n in grads:
                    e, padded = _padded(local(n, shape), shards)
                    rlo += e * (reduce_size or size)
                    rhi += padded * (reduce_size or size)
            if shards > 1:
                add("reduce_scatter", 1, rlo, rhi, f"{name} x1")
            if replicas > 1:
                add("all_reduce", 1, rlo // shards, -(-rhi // shards), f"{name} x1")
    return out


#: tensor-parallel styles by what their forward does with the output (DTensor's ColwiseParallel and
#: RowwiseParallel with transformers' layouts), and what their backward does with the input's gradient
_GATHERS_OUTPUT = ("colwise_gather_output", "colwise_rep", "embedding_colwise")
_SUMS_OUTPUT = ("rowwise", "rowwise_split_input", "rowwise_rep", "embedding_rowwise")
_SUMS_INPUT_GRAD = ("colwise", "colwise_gather_output", "colwise_rep")
_GATHERS_INPUT_GRAD = ("rowwise_split_input", "rowwise_rep")


def _expect_tensor_parallel(u: dict[str, Any], config: Any, dp: int, a: int, add: Any) -> None:
    """The tp group's collectives for the split modules whose forward is unit ``u``'s, per step of
    ``a`` micro-batches, each micro-batch's rows split over ``dp`` data-parallel groups:

    - forward: a gathered output (``colwise_gather_output``) is an all-gather of the output; a
      summed one (``rowwise``, ``embedding_rowwise``) an all-reduce of it; a split one none;
    - backward, where the input needs a gradient: a colwise layer's input came whole, so its
      gradient is summed over the tp ranks (an all-reduce), once for the layers of one parent that
      read the same tensor (q, k and v); a ``rowwise_split_input`` layer's was split locally, so
      its gradient is gathered; a rowwise layer's stays split;
    - activation checkpointing runs the unit's forward again in backward, collectives included;
    - bytes: the full-size tensor, in the compute dtype (``mixed_precision.param_dtype``)."""
    mp = config.mixed_precision
    compute = itemsize(mp.param_dtype) if mp is not None else None
    recomputed = config.activation_checkpointing and u["path"] != "" and u["in_backward"]
    forwards = a * (2 if recomputed else 1)
    summed_inputs: set[str] = set()
    for m in u.get("tp_modules", []):
        style, name = m["style"], m["name"]
        out_b = m["out_elems"] // dp * (compute or m["out_size"])
        in_b = m["in_elems"] // dp * (compute or m["in_size"])
        if style in _GATHERS_OUTPUT:
            add("all_gather", forwards, out_b, out_b, f"{name} output x{forwards}")
        elif style in _SUMS_OUTPUT:
            add("all_reduce", forwards, out_b, out_b, f"{name} output x{forwards}")
        if m["in_grad"] and u["in_backward"]:
            if style in _SUMS_INPUT_GRAD and m["input_of"] not in summed_inputs:
                summed_inputs.add(m["input_of"])
                add("all_reduce", a, in_b, in_b, f"{m['input_of']} input gradient x{a}")
            elif style in _GATHERS_INPUT_GRAD:
                add("all_gather", a, in_b, in_b, f"{name} input gradient x{a}")


def predictions() -> dict[str, Any]:
    """``communication_pattern`` -> the prediction of a step's collectives from the reference's
    units, the config, the world size (SPMD: devices) and the accumulation steps."""
    from .xla_comm import expected_spmd, expected_xla_fsdp

    return {"fsdp": expected_fsdp, "xla_fsdp": expected_xla_fsdp, "spmd": expected_spmd}


def check(observed: list[list[dict[str, Any]]], expected: Any) -> list[str]:
    """Mismatches of every rank's every step against ``expected`` (empty: all match).
    ``observed[rank][step]`` is a :class:`CommRecorder` step; ``expected`` the counts and bytes of
    :func:`expected_fsdp`, or an expectation with its own ``check`` (SPMD's floors)."""
    if hasattr(expected, "check"):
        return expected.check(observed)
    problems = []
    for rank, steps in enumerate(observed):
        for i, step in enumerate(steps):
            for kind in KINDS:
                got, want = step[kind], expected[kind]
                lo, hi = want["bytes"]
                if got["count"] != want["count"]:
                    problems.append(
                        f"communication differs at step {i} on rank {rank}: {got['count']} {kind} calls, expected "
                        f"{want['count']} (per unit: {', '.join(want['why']) or 'none'})"
                    )
                elif not lo <= got["bytes"] <= hi:
                    problems.append(
                        f"communication differs at step {i} on rank {rank}: {kind} moved {got['bytes']} bytes, "
                        f"expected {lo}" + (f" to {hi} (padding)" if hi != lo else "")
                    )
            if problems:
                return problems
    return problems
