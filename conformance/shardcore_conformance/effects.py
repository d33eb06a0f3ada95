"""What a key did, observed in the run itself: the checks that see a key whose effect leaves the
numbers and the collectives as they were.

* **recomputation** (``activation_checkpointing``, ``xla_fsdp_grad_ckpt``): every module that holds
  parameters counts its forward calls in the first optimizer step. Recomputing a unit runs the
  forward of each module inside it once more in backward, so the sharded run must count, per module
  class, the reference's calls plus one more for each call inside a plan unit, and without the key
  exactly the reference's. A forward hook sees the recomputation whatever does it (non-reentrant
  ``torch.utils.checkpoint``, torch_xla's ``checkpoint_module``), on eager and lazy tensors alike.
* **compute dtype** (``mixed_precision``): the dtype of each such module's output in that step, per
  class, must be the reference's, which computes in the case's dtype. (XLA's ``compute_dtype`` is held
  to its all-gather bytes instead: see ``compare.py`` and conformance/README.md.)
* **rank 0's weights** (``cpu_ram_efficient_loading``): every rank but 0 builds the model with other
  weights; the key says that rank 0's are the ones sharded, so the numbers then tell.
* **process-group timeout** (``timeout``): the timeout of the group the run used, read back.

Compiled cases install no hooks: dynamo would trace them into the units' graphs, and a recomputation
inside a compiled backward runs no Python at all.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from typing import Any, Iterator

import torch
from torch import nn

RECOMPUTATION_KEYS = ("activation_checkpointing", "xla_fsdp_grad_ckpt")


def holder_classes(model: nn.Module) -> frozenset[str]:
    """Class names of the modules of an unwrapped ``model`` that hold parameters themselves (Linear,
    Embedding, norms, GPT-2's Conv1D). A wrapper may take a module's parameters away (XLA FSDP
    registers the shards on itself), so the sharded run finds its modules by these names."""
    return frozenset(type(m).__name__ for m in model.modules() if next(m.parameters(recurse=False), None) is not None)


def _class_of(module: nn.Module, classes: frozenset[str]) -> str | None:
    """The original class name of ``module`` (FSDP2 makes a unit an instance of ``FSDP<Class>``)."""
    return next((c.__name__ for c in type(module).__mro__ if c.__name__ in classes), None)


def _first_float(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, (tuple, list)):
        return next((t for t in map(_first_float, output) if t is not None), None)
    return None


class ModuleCalls:
    """Forward calls and output dtypes of the modules of ``classes`` while recording, by module name
    (the reference, whose names are the model's own) or by class (a sharded model, whose wrappers
    rename). Hooks are plain closures, so a deep copy of the model (the bf16 reference's per-step
    copy) records into the same counters."""

    def __init__(self, model: nn.Module, classes: frozenset[str], by_name: bool, units: tuple[str, ...] = ()) -> None:
        self.calls: Counter[str] = Counter()
        self.dtypes: dict[str, set[str]] = {}
        self.kinds: dict[str, str] = {}  # name -> class, by_name only
        #: unit path -> whether a tensor it was called with required grad (the reference's ``units``)
        self.grad_inputs: dict[str, bool] = {}
        self._on = False
        self._handles = []
        for path in units:
            self._handles.append(
                model.get_submodule(path).register_forward_pre_hook(self._unit_hook(path), with_kwargs=True)
            )
        for name, m in model.named_modules():
            cls = _class_of(m, classes)
            if cls is None:
                continue
            key = name if by_name else cls
            self.kinds[key] = cls
            self._handles.append(m.register_forward_hook(self._hook(key)))

    def _hook(self, key: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._on:
                return
            self.calls[key] += 1
            t = _first_float(output)
            if t is not None:
                self.dtypes.setdefault(key, set()).add(str(t.dtype).removeprefix("torch."))

        return hook

    def _unit_hook(self, path: str):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self._on:
                tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                self.grad_inputs[path] = self.grad_inputs.get(path, False) or any(t.requires_grad for t in tensors)

        return hook

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def record(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "dtypes": {k: sorted(v) for k, v in self.dtypes.items()},
            "classes": dict(self.kinds),
            "grad_inputs": dict(self.grad_inputs),
        }


def compute_dtype_name(config: Any) -> str | None:
    """The low-precision dtype a parsed config computes in (the ``mixed_precision`` param dtype, else
    XLA's ``xla_fsdp_settings.compute_dtype``), or None: full precision."""
    from shardcore.config.fields import dtype_name

    mp = config.mixed_precision
    if mp is not None and mp.param_dtype is not None:
        return dtype_name("mixed_precision.param_dtype", mp.param_dtype)
    return dtype_name("xla_fsdp_settings.compute_dtype", dict(config.xla_fsdp_settings).get("compute_dtype"))


def recomputing_key(config: Any) -> str | None:
    """The key that asks for recomputation in this parsed config, or None."""
    return next((k for k in RECOMPUTATION_KEYS if getattr(config, k, False)), None)


def _unit_of(name: str, units: list[str]) -> str | None:
    """The innermost unit ``name`` lies strictly inside: a unit that is itself such a module recomputes
    through its forward function, not its ``__call__``, so no hook of its own sees that."""
    inside = [u for u in units if name.startswith(u + ".")]
    return max(inside, key=len) if inside else None


def expected_calls(ref: dict[str, Any], units: list[str], recompute: bool) -> dict[str, tuple[int, int]]:
    """Per class, the fewest and most calls a sharded run makes in its first step: the reference's,
    and with recomputation once more for every call of a module inside a (non-root) unit. A unit none
    of whose inputs required grad may be left alone: reentrant checkpointing (torch_xla's
    ``checkpoint_module``) cannot checkpoint it without losing its parameters' gradients, so it runs
    such a unit plainly; non-reentrant ``torch.utils.checkpoint`` recomputes it."""
    lo: Counter[str] = Counter()
    hi: Counter[str] = Counter()
    grad_inputs = ref.get("grad_inputs", {})
    for name, n in ref["calls"].items():
        cls = ref["classes"][name]
        unit = _unit_of(name, units) if recompute else None
        lo[cls] += n * (2 if unit is not None and grad_inputs.get(unit, True) else 1)
        hi[cls] += n * (2 if unit is not None else 1)
    return {c: (lo[c], hi[c]) for c in lo}


def recomputation_problems(ref: dict[str, Any], got: list[dict[str, Any]], units: list[str], config: Any) -> list[str]:
    """Each rank's calls per class against :func:`expected_calls`; at most one problem."""
    key = recomputing_key(config)
    expected = expected_calls(ref, units, key is not None)
    for rank, rec in enumerate(got):
        calls = rec["calls"]
        wrong = sorted(
            c
            for c in set(expected) | set(calls)
            if not expected.get(c, (0, 0))[0] <= calls.get(c, 0) <= expected.get(c, (0, 0))[1]
        )
        if not wrong:
            continue
        c = wrong[0]
        n, (lo, hi) = calls.get(c, 0), expected.get(c, (0, 0))
        want = f"{lo}" if lo == hi else f"{lo} to {hi}"
        if key is not None:
            why = (
                f"{key} is set, so each unit's forward runs again in backward "
                f"({', '.join(units) or 'no unit'}): {'too few modules recomputed' if n < lo else 'more calls than one recomputation'}"
            )
        else:
            why = "no key asks for recomputation, yet modules ran more often than the reference's"
        return [f"recomputation differs in step 0 on rank {rank}: {c} ran forward {n} times, expected {want}; {why}"]
    return []


def dtype_problems(ref: dict[str, Any], got: list[dict[str, Any]], compute: str | None) -> list[str]:
    """Each rank's output dtypes per class against the reference's; at most one problem."""
    want: dict[str, set[str]] = {}
    for name, dts in ref["dtypes"].items():
        want.setdefault(ref["classes"][name], set()).update(dts)
    for rank, rec in enumerate(got):
        have = {c: set(d) for c, d in rec["dtypes"].items()}
        for c in sorted(set(want) | set(have)):
            if want.get(c, set()) != have.get(c, set()):
                by = f" ({compute} compute)" if compute else ""
                return [
                    f"compute dtype differs in step 0 on rank {rank}: {c} computed in "
                    f"{', '.join(sorted(have.get(c, ()))) or 'nothing'}, the reference{by} in "
                    f"{', '.join(sorted(want.get(c, ()))) or 'nothing'}"
                ]
    return []


def other_weights(model: nn.Module) -> None:
    """What a rank other than 0 holds under ``cpu_ram_efficient_loading`` in the suite: weights that
    are not rank 0's (each floating-point parameter shifted by 1), so that training from them shows."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(1.0)


def group_timeout() -> float | None:
    """Seconds of the default process group's timeout (the smallest over its backends), or None
    where no torch.distributed group exists or its backends do not say."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.group.WORLD
    seen = []
    for device in getattr(group, "_device_types", []):
        try:
            seen.append(group._get_backend(device).options._timeout.total_seconds())
        except (AttributeError, RuntimeError):
            continue
    return min(seen) if seen else None


class ModelWrites:
    """Which threads open a save's model files for writing under ``root`` (Python's ``open`` audit
    event, which DCP's file writer and shardcore's manifest raise): with ``async_save`` no such file
    may be written by the thread that called ``save()`` before it returned. The ranks' own small
    state files and the step marker are written before it returns by design, so they do not count.

    Audit hooks cannot be removed: one is installed per process, and records only while a recorder
    is active."""

    _active: ModelWrites | None = None
    _installed = False
    _EXEMPT = ("rank-", "shardcore-step.json", ".shardcore-step.json")

    def __init__(self, root: Any) -> None:
        import threading

        self.root = os.fspath(root)
        self.caller = threading.get_ident()
        self.saving = False
        self.on_caller = 0  # opened by the caller while save() ran
        self.in_background = 0  # opened by any other thread
        if not ModelWrites._installed:
            sys.addaudithook(ModelWrites._hook)
            ModelWrites._installed = True

    def start(self) -> ModelWrites:
        ModelWrites._active = self
        return self

    def stop(self) -> None:
        ModelWrites._active = None

    @contextlib.contextmanager
    def save(self) -> Iterator[None]:
        self.saving = True
        try:
            yield
        finally:
            self.saving = False

    def facts(self) -> dict[str, int]:
        return {"on_caller": self.on_caller, "in_background": self.in_background}

    @staticmethod
    def _hook(event: str, args: tuple) -> None:
        w = ModelWrites._active
        if w is None or event != "open":
            return
        try:
            import threading

            path, mode, flags = args
            if isinstance(path, int):
                return
            path = os.fsdecode(path)
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags > 0 and flags & (os.O_WRONLY | os.O_RDWR)
            )
            if not writing or not path.startswith(w.root) or os.path.basename(path).startswith(ModelWrites._EXEMPT):
                return
            if threading.get_ident() == w.caller:
                w.on_caller += int(w.saving)
            else:
                w.in_background += 1
        except Exception:  # noqa: BLE001 - an audit hook must never fail the open it watches
            return
