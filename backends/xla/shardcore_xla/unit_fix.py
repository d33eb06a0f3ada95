"""Workarounds for two torch_xla XLA FSDP bugs hit by units whose forward returns several tensors
that carry gradients (``LlamaAttention`` returns ``attn_output`` and ``attn_weights``, the second an
autograd ancestor of the first). Users cannot change their model's outputs, so shardcore fixes it.

1. Stale weights. XLA FSDP registers its pre-backward hook on every output. The gradient reaches the
   first output: all-gather, and the post-backward hook frees the full parameters. Then it reaches
   the second: the hook fires again and re-gathers parameters whose post-backward hook has already
   run, so nothing frees them. ``_wait_for_post_backward`` only frees modules whose pre-backward never
   ran, and the next forward's ``_rebuild_full_params`` skips parameters still marked
   ``_has_full_param``: that forward computes with the weights of before the optimizer step.
   Gradients are right, the forward is silently wrong. Fix: when backward ends, free every unit's
   full parameters that are still gathered (the next forward gathers them again).
2. ``xla_fsdp_grad_ckpt`` crash. Under ``checkpoint_module`` both outputs come from one autograd node,
   and the output that gets no gradient hands ``None`` to the pre-backward hook, whose optimization
   barrier then raises "Invoked with: [None]". Fix: ``optimization_barrier_in_backward=False`` on
   checkpointed units (the barrier only orders XLA's scheduling; the values are the same).

3. Pre-backward hooks skipped now and then. XLA FSDP decides whether an output already has its hook
   by ``id(t) in _output_pre_backward_hook_registered``, a set of the ids of every unit output of the
   forward, shared by the root's units and cleared when backward ends. An output whose Python object
   died (``attn_output`` after the residual add) leaves its id behind, and CPython gives a later
   object the same address: a later unit's second output (``attn_weights``, the root's ``logits``)
   is taken for hooked and gets no hook. Which ids collide depends on the allocator, so it differs
   from step to step and from device to device: graphs change (one fewer optimization barrier or
   all-gather), every change recompiles, and on several CPU devices in one process two devices ran
   different modules and XLA aborted the process at a rendezvous. Fix: the set forgets an id once
   the object it was recorded for is gone (:class:`LiveIds`).

4. Wasted all-gathers. The second output's pre-backward hook (bug 1) re-gathers the parameters
   whose post-backward hook already ran, only for fix 1 to free them: communication that no
   computation uses (the suite's communication check counted 2 extra all-gathers per step for each
   two-output unit). Fix: a unit past its post-backward hooks (``BACKWARD_POST``) does not rebuild
   its full parameters; fix 1 stays, as the guard that nothing is left gathered.

All touch torch_xla private members; :func:`check_private_api` verifies they exist, and
``VERIFIED`` names the torch_xla releases the fixes were verified on (parity with eager CPU over
every unit shape of the conformance suite).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

from shardcore.backend import release

log = logging.getLogger(__name__)

#: torch_xla releases in which both bugs were reproduced and these fixes verified
VERIFIED = ("2.9",)
# methods overridden or called; the instance attributes (full_params, _has_full_param,
# _require_backward_grad_sync) are read with getattr and checked in the tests
_PRIVATE = (
    "_wait_for_post_backward",
    "_free_full_params",
    "_rebuild_full_params",
    "_register_pre_backward_hooks",
    "_setup_output_hook_and_backward_opt_barrier_lists",
)


def warn_if_unverified(version: str) -> None:
    """No torch_xla release is known to fix the bugs, so the fixes apply to every version; one newer
    than those verified gets a warning (the private members are checked separately)."""
    if release(version) > max(release(v) for v in VERIFIED):
        log.warning(
            "shardcore xla: torch_xla %s is newer than the releases the multi-output unit fixes were verified on (%s)",
            version,
            ", ".join(VERIFIED),
        )


@functools.lru_cache(maxsize=None)
def fsdp_class() -> type:
    """``XlaFullyShardedDataParallel`` with fixes 1 and 3."""
    import torch_xla
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    warn_if_unverified(torch_xla.__version__)
    check_private_api(FSDP)

    class ShardcoreXlaFSDP(FSDP):
        """XlaFullyShardedDataParallel that frees full parameters a unit re-gathered after its
        post-backward hook ran, and hooks every output whatever ids CPython recycles (see the
        module docstring)."""

        def _wait_for_post_backward(self) -> None:
            super()._wait_for_post_backward()
            free_leftover_full_params(self)

        def _setup_output_hook_and_backward_opt_barrier_lists(self) -> None:
            super()._setup_output_hook_and_backward_opt_barrier_lists()
            live = LiveIds()
            for m in self.modules():
                if isinstance(m, FSDP):
                    m._output_pre_backward_hook_registered = live

        def _rebuild_full_params(self, *args: Any, **kwargs: Any) -> Any:
            # fix 4: once this unit's post-backward hooks ran (BACKWARD_POST), its parameters'
            # gradients are final and no later backward op reads them; the pre-backward hook of a
            # further output would gather them again only for fix 1 to free them (2 all-gathers
            # per step for each two-output unit of the conformance suite, which no one used)
            from torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel import TrainingState

            if self.training_state == TrainingState.BACKWARD_POST:
                return None
            return super()._rebuild_full_params(*args, **kwargs)

        def _register_pre_backward_hooks(self, outputs: Any) -> Any:
            registered = self._output_pre_backward_hook_registered
            outputs = super()._register_pre_backward_hooks(outputs)
            if isinstance(registered, LiveIds):
                registered.track(outputs)
            return outputs

    return ShardcoreXlaFSDP


def free_leftover_full_params(root: Any) -> int:
    """Free the full parameters still gathered after backward in every XLA FSDP module under
    ``root``; returns how many. Within ``no_sync`` (no gradient reduction) gathered parameters are
    kept on purpose, since no optimizer step runs before the next forward."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    freed = 0
    for m in root.modules():
        if not isinstance(m, FSDP) or not getattr(m, "_require_backward_grad_sync", True):
            continue
        stale = [p for p in getattr(m, "full_params", ()) if getattr(p, "_has_full_param", False)]
        if stale:
            m._free_full_params(stale, apply_opt_barrier=m.optimization_barrier_in_backward)
            freed += len(stale)
    return freed


class LiveIds(set):
    """XLA FSDP's set of hooked output ids (fix 3), which holds an id only while the object it was
    recorded for is alive: a tensor whose id is recycled is not taken for hooked.

    torch_xla adds bare ids (``add(id(t))``) and tests them (``id(t) in``); :meth:`track`, called
    right after each unit's outputs were hooked, pins each new id to its tensor through a weak
    reference. Until then an id's object is alive: it is one of the outputs being returned."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}

    def __contains__(self, key: object) -> bool:
        if not super().__contains__(key):
            return False
        ref = self._refs.get(key)  # type: ignore[arg-type]
        if ref is not None and ref() is None:
            self.discard(key)
            del self._refs[key]  # type: ignore[arg-type]
            return False
        return True

    def track(self, outputs: Any) -> None:
        from torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel import collect_tensors

        for t in collect_tensors(outputs):
            ref = self._refs.get(id(t))
            # a unit's first output is hooked without asking the set, so its id may come with the
            # reference of a dead object that had the same address: pin it to this one
            if super().__contains__(id(t)) and (ref is None or ref() is not t):
                self._refs[id(t)] = weakref.ref(t)

    def clear(self) -> None:
        super().clear()
        self._refs.clear()


def checkpointed_unit_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a unit wrapped around ``checkpoint_module``: fix 2."""
    return {**kwargs, "optimization_barrier_in_backward": False}


def check_private_api(cls: type) -> None:
    missing = [n for n in _PRIVATE if not callable(getattr(cls, n, None))]
    if missing:  # pragma: no cover - depends on the installed torch_xla
        from shardcore.errors import BackendUnavailableError

        raise BackendUnavailableError(
            f"shardcore xla: this torch_xla lacks {', '.join(missing)}, which shardcore's fix for units that return "
            f"several tensors relies on (verified on torch_xla {', '.join(VERIFIED)}). Install torch_xla==2.9.0."
        )
