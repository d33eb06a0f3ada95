"""Communication accounting for the XLA backends, read from the HLO torch_xla lowers a step to.

* XLA FSDP (``communication_pattern = "xla_fsdp"``): each rank's own traced graph of the step holds
  its collectives (:class:`XlaGraphRecorder`), predicted per parameter tensor by
  :func:`expected_xla_fsdp`.
* SPMD (``"spmd"``): the traced graph holds none; the partitioner inserts them when XLA compiles the
  step. :class:`SpmdGraphRecorder` reads the graph after XLA's passes, partitioning included. What
  the partitioner picks (which tensors it gathers, reductions fused or split, all-reduce or
  reduce-scatter) is the compiler's choice and differs between platforms, so it is reported and not
  predicted. What the config does decide is checked (:func:`expected_spmd`): parameters sharded over
  ``fsdp`` are gathered over that axis, gradients are summed across every device that holds other
  rows of the batch, and no collective runs over a group that is not an axis of the mesh.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from .comm import _empty_expectation, _empty_step, _padded, itemsize

#: torch_xla returns the HLO after XLA's optimization passes (the partitioned program) when this is
#: set; it reads the variable once per process, at its first HLO dump
POST_OPTIMIZATIONS = "XLA_DUMP_POST_OPTIMIZATIONS"


class XlaGraphRecorder:
    """XLA FSDP: the collectives in each rank's own traced graph of the step. After the step's last
    backward, the gradients' pending graph (every forward and backward of the step, micro-batches
    included) is lowered to HLO text by torch_xla (``_XLAC._get_xla_tensors_hlo``), and its
    ``all-gather``, ``reduce-scatter`` and ``all-reduce`` instructions are counted with the bytes of
    their full-size tensors. Per rank: each device traces its own graph, also when the devices are
    threads of one process (torch_xla's counters are process-wide). A graph whose hash was read
    before is not lowered again: the hash is torch_xla's compile-cache key, so the same hash is the
    same program."""

    def __init__(self, world_size: int) -> None:
        self.steps: list[dict[str, dict[str, Any]]] = []
        self.world_size = world_size
        self._seen: dict[Any, dict[str, dict[str, Any]]] = {}

    def install(self) -> "XlaGraphRecorder":
        return self

    def uninstall(self) -> None:
        pass

    def begin_step(self) -> None:
        self.steps.append(_empty_step())

    def recording(self) -> Any:
        return contextlib.nullcontext()

    def after_backward(self, model: nn.Module) -> None:
        import torch_xla

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        key = torch_xla._XLAC._get_graph_hash(grads)
        if key not in self._seen:
            self._seen[key] = hlo_collectives(self._hlo(grads), self.world_size)
        self.steps[-1] = copy.deepcopy(self._seen[key])

    def _hlo(self, grads: list[Any]) -> str:
        import torch_xla

        return torch_xla._XLAC._get_xla_tensors_hlo(grads)


class SpmdGraphRecorder(XlaGraphRecorder):
    """SPMD: the collectives of the step as XLA partitioned it, for every device (one program runs on
    all of them). After the step's last backward the gradients' pending graph is compiled for its
    post-optimization HLO (:data:`POST_OPTIMIZATIONS`), an extra compile of the step's forward and
    backward, about 2 s for the suite's Llama on 2 CPU cores."""

    def install(self) -> "SpmdGraphRecorder":
        os.environ[POST_OPTIMIZATIONS] = "1"
        return self

    def _hlo(self, grads: list[Any]) -> str:
        text = super()._hlo(grads)
        if "is_scheduled=true" not in text.split("\n", 1)[0]:
            raise RuntimeError(
                "shardcore-conformance: torch_xla returned the step's HLO before partitioning, which holds no "
                f"collectives: this process read {POST_OPTIMIZATIONS} before the suite set it (torch_xla reads "
                f"it once). Start the run with {POST_OPTIMIZATIONS}=1 in its environment."
            )
        return text


_HLO_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
_HLO_OP = re.compile(r"=\s*(.*?)\s(all-gather|reduce-scatter|all-reduce)\((.*)$")
_HLO_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|u32|s8|u8|pred)\[([\d,]*)\]")
_HLO_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
#: XLA's compact form, ``replica_groups=[G,S]<=[dims]T(perm)``: the devices arange(prod(dims))
#: reshaped to ``dims``, transposed by ``perm`` (if given), and cut into G groups of S
_HLO_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def _first_group(rest: str, world_size: int) -> list[int]:
    """The devices of the first replica group of a collective (``{}``: every device)."""
    groups = _HLO_GROUPS.search(rest)
    if groups:
        return [int(d) for d in groups.group(1).split(",") if d]
    iota = _HLO_IOTA_GROUPS.search(rest)
    if iota:
        import numpy as np

        n_groups, size, dims, perm = iota.groups()
        devices = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
        if perm:
            devices = devices.transpose([int(p) for p in perm.split(",")])
        return [int(d) for d in devices.reshape(int(n_groups), int(size))[0]]
    return list(range(world_size))


def _shape_bytes(text: str) -> int:
    """Bytes of the non-scalar shapes in ``text`` (a scalar is a collective's token, not data)."""
    total = 0
    for dtype, dims in _HLO_SHAPE.findall(text):
        if dims:
            total += math.prod(int(d) for d in dims.split(",")) * _HLO_BYTES[dtype]
    return total


def hlo_collectives(text: str, world_size: int) -> dict[str, dict[str, Any]]:
    """Counts and full-size bytes of the collectives in HLO ``text``: an all-gather's result, a
    reduce-scatter's operands, an all-reduce's result. Groups of one rank are not communication."""
    step = _empty_step()
    kinds = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce"}
    for line in text.splitlines():
        m = _HLO_OP.search(line)
        if m is None:
            continue
        result, op, rest = m.groups()
        group = _first_group(rest, world_size)
        size = len(group)
        if size == 1:
            continue
        operands = rest.split(")", 1)[0]
        s = step[kinds[op]]
        s["count"] += 1
        s["bytes"] += _shape_bytes(operands if op == "reduce-scatter" else result)
        if size not in s["group_sizes"]:
            s["group_sizes"].append(size)
        if group not in s["groups"]:
            s["groups"].append(group)
    return step


def expected_xla_fsdp(
    units: list[dict[str, Any]], config: Any, world_size: int, grad_accum: int
) -> dict[str, dict[str, Any]] | None:
    """XLA FSDP (``XlaFullyShardedDataParallel`` as shardcore wraps it: parameters not flattened, no
    reduce-scatter buckets), per parameter tensor of a unit (the root too), per optimizer step of
    ``A`` micro-batches:

    - all-gathers: a unit resharded after forward (``reshard_after_forward`` and not the root, which
      XLA FSDP keeps gathered) gathers each tensor in every micro-batch's forward, and again in its
      backward when the backward reaches it. A unit that is not resharded keeps its tensors gathered
      across ``no_sync`` micro-batches: once per step, except tensors without a gradient (frozen, or a
      unit the backward does not reach), which are freed when each backward ends;
    - reduce-scatters: one per tensor with a gradient per step;
    - bytes: the all-gather in the compute dtype (``xla_fsdp_settings.compute_dtype``, else the
      parameter's), the reduce-scatter in the parameter's (the gradient of the full parameter);
      each tensor flattened and padded to a multiple of 128 x the world size.

    ``flatten_parameters``: one flat tensor per unit. Coalesced collectives
    (``reduce_scatter_bucket_size_mb``, ``coalesce_all_gather_ops``) are not predicted: None.
    """
    settings = dict(config.xla_fsdp_settings)
    if settings.get("reduce_scatter_bucket_size_mb") or settings.get("coalesce_all_gather_ops"):
        return None  # coalesced collectives: not predicted (the case is reported, not checked)
    compute = str(settings.get("compute_dtype") or "").removeprefix("torch.")
    gather_size = itemsize(compute or None)
    multiple = 128 * world_size
    a = grad_accum
    out = _empty_expectation()
    if world_size == 1:
        return out
    for u in units:
        if not u["params"]:
            continue
        name = u["path"] or "<root>"
        resharded = config.reshard_after_forward and u["path"] != ""
        grads = set(u["with_grad"])
        tensors = u["params"]
        if settings.get("flatten_parameters"):  # one flat tensor per unit
            tensors = [["<flat>", [sum(math.prod(t[1]) for t in tensors)], tensors[0][2]]]
            grads = {"<flat>"} if grads else set()
        before = out["all_gather"]["count"]
        for pname, shape, size in tensors:
            if resharded:
                n_gather = a * (2 if u["in_backward"] else 1)
            else:
                n_gather = 1 if u["in_backward"] and pname in grads else a
            n = math.prod(shape)
            padded = -(-n // multiple) * multiple
            if settings.get("shard_param_on_dim_0"):  # dim 0 padded to a multiple of the world size
                padded = max(padded, _padded(shape, world_size)[1])
            g = gather_size or size
            out["all_gather"]["count"] += n_gather
            out["all_gather"]["bytes"][0] += n_gather * n * g
            out["all_gather"]["bytes"][1] += n_gather * padded * g
            if pname in grads:
                out["reduce_scatter"]["count"] += 1
                out["reduce_scatter"]["bytes"][0] += n * size
                out["reduce_scatter"]["bytes"][1] += padded * size
        out["all_gather"]["why"].append(f"{name} {out['all_gather']['count'] - before}")
        if grads:
            out["reduce_scatter"]["why"].append(f"{name} {len(grads)}")
    return out


@dataclass(frozen=True)
class Floor:
    """A collective the config makes necessary whatever the compiler picks: at least one call of one
    of ``kinds`` over a group along one of ``axes`` of the mesh (``fsdp``, ``replicate``, ``all``)."""

    kinds: tuple[str, ...]
    axes: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class SpmdExpectation:
    """What SPMD's communication must show on a mesh of ``replicas`` x ``shards`` x ``tp`` devices,
    ``tensor`` innermost: device ``d`` at replica ``d // (shards * tp)``, shard ``d // tp % shards``
    and tensor slice ``d % tp`` (:func:`expected_spmd`)."""

    replicas: int
    shards: int
    floors: tuple[Floor, ...]
    tp: int = 1

    def axes_of(self, group: list[int]) -> frozenset[str] | None:
        """The mesh axes ``group`` (a replica group's devices) runs along: those whose coordinate
        differs within it, when it is every device that differs from its first only there; None when
        it is no such group."""
        sizes = {"replicate": self.replicas, "fsdp": self.shards, "tensor": self.tp}

        def coords(d: int) -> dict[str, int]:
            return {
                "replicate": d // (self.shards * self.tp),
                "fsdp": d // self.tp % self.shards,
                "tensor": d % self.tp,
            }

        if not group:
            return None
        first = coords(group[0])
        varying = frozenset(a for a in sizes if any(coords(d)[a] != first[a] for d in group))
        size = math.prod(sizes[a] for a in varying)
        if len(set(group)) != len(group) or len(group) != size:
            return None
        if any(coords(d)[a] != first[a] for d in group for a in sizes if a not in varying):
            return None
        return varying

    def axis(self, group: list[int]) -> str | None:
        """Which axis of the mesh ``group`` runs along: ``fsdp``, ``replicate``, ``tensor``, two of
        them joined by ``+``, ``all``; None: none."""
        axes = self.axes_of(group)
        if axes is None:
            return None
        real = {a for a, n in (("replicate", self.replicas), ("fsdp", self.shards), ("tensor", self.tp)) if n > 1}
        if axes == real and len(real) > 1:
            return "all"
        return "+".join(a for a in ("replicate", "fsdp", "tensor") if a in axes) or None

    def _along(self, group: list[int], axes: tuple[str, ...]) -> bool:
        """Whether ``group`` runs along one of ``axes`` (``all``: every device), alone or with others."""
        have = self.axes_of(group)
        return have is not None and any(a == "all" and self.axis(group) == "all" or a in have for a in axes)

    def _shape(self) -> str:
        if self.tp > 1:
            return f"{self.replicas} x {self.shards} x {self.tp} mesh (replicate x fsdp x tensor)"
        return f"{self.replicas} x {self.shards} mesh (replicate x fsdp)"

    def check(self, observed: list[list[dict[str, Any]]]) -> list[str]:
        """Mismatches of every step (one program runs on every device: rank 0 holds it) against the
        floors, and any group that is not an axis of the mesh."""
        for i, step in enumerate(observed[0]):
            for kind, rec in step.items():
                odd = [g for g in rec["groups"] if self.axis(g) is None]
                if odd:
                    return [
                        f"communication differs at step {i}: {kind} over devices {odd[0]}, which is no axis of the "
                        f"{self._shape()}"
                    ]
            for f in self.floors:
                if not any(self._along(g, f.axes) for k in f.kinds for g in step[k]["groups"]):
                    seen = "; ".join(f"{step[k]['count']} {k} over {step[k]['groups'] or 'no group'}" for k in f.kinds)
                    return [
                        f"communication differs at step {i}: no {' or '.join(f.kinds)} along "
                        f"{' or '.join(f.axes)} ({seen}), but {f.why}"
                    ]
        return []


def expected_spmd(units: list[dict[str, Any]], config: Any, devices: int, grad_accum: int) -> SpmdExpectation:
    """SPMD FSDPv2 on ``devices`` devices as ``replicas`` x ``shards`` (``dp_replicate_size``): every
    parameter is sharded over the ``fsdp`` axis and the batch over every device. So, in every
    optimizer step, whatever the partitioner picks:

    - with ``shards`` > 1, parameters are all-gathered along ``fsdp`` (a run that kept them whole on
      every device would not be ZeRO-3);
    - with trainable parameters, gradients are summed over the devices holding other rows of the
      batch: an all-reduce or reduce-scatter along ``fsdp`` (or all devices), and with HSDP one
      across replicas too. A run whose devices each computed the whole batch needs none, and is
      right at 1 / devices the speed;
    - with ``tp_size`` > 1 and a rowwise layer in the plan, an all-reduce (or reduce-scatter) along
      ``tensor`` sums that layer's partial products;
    - every collective runs along an axis of the mesh, or along several of them."""
    from shardcore.validate import data_parallel_shape

    replicas, shards = data_parallel_shape(config, devices)
    tp = getattr(config, "tp_size", 1)
    floors = []
    if shards > 1 and any(u["params"] for u in units):
        floors.append(Floor(("all_gather",), ("fsdp", "all"), f"the parameters are sharded over {shards} devices"))
    if any(u["with_grad"] for u in units):
        reduce = ("all_reduce", "reduce_scatter")
        why = "the batch is sharded over every data-parallel device, so each gradient is a sum over "
        if shards > 1:
            floors.append(Floor(reduce, ("fsdp", "all"), why + f"the {shards} shards"))
        if replicas > 1:
            floors.append(Floor(reduce, ("replicate", "all"), why + f"the {replicas} replicas"))
    rows = [m["name"] for u in units for m in u.get("tp_modules", []) if m["style"].startswith("rowwise")]
    if tp > 1 and rows:
        floors.append(
            Floor(
                ("all_reduce", "reduce_scatter"),
                ("tensor",),
                f"{rows[0]} is split along its input features over the {tp} tensor devices (rowwise), so its "
                "output is a sum of their partial products",
            )
        )
    return SpmdExpectation(replicas, shards, tuple(floors), tp)
