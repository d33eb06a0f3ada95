"""Working multi-device collectives for XLA FSDP on CPU PJRT (a workaround, CPU only).

torch_xla 2.9 builds ``all_gather``/``reduce_scatter``/``all_reduce`` without a channel id. XLA:CPU
then tells collectives apart by the compiled module's ``unique_id``, and under ``xmp.spawn`` every
device thread compiles its own module, so the devices wait at different op ids until the rendezvous
times out ("Expected 2 threads to join"; pytorch/xla#9089, #5005; torch_xla's own
``test/run_tests.sh`` runs its multi-process tests with one CPU device for this reason).

Giving every collective an explicit channel id, numbered in program order and restarted at each
graph cut, makes the threads agree. ``install()`` swaps the three functions in ``torch_xla.core.
xla_model`` (before ``XlaFullyShardedDataParallel`` binds them); ``reset()`` is called after every
``torch_xla.sync()``. Only used when the PJRT device is CPU and more than one device takes part;
TPU and GPU keep torch_xla's own collectives.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

_tls = threading.local()
_installed = False
_orig: dict[str, Any] = {}


def _next_id() -> int:
    _tls.cid = getattr(_tls, "cid", 0) + 1
    return _tls.cid


def reset() -> None:
    """Restart channel numbering: call after each graph cut, so each step's graph gets the same
    ids as the last (and hits the compile cache)."""
    _tls.cid = 0


def needed() -> bool:
    import torch_xla.runtime as xr

    return xr.device_type() == "CPU" and xr.world_size() > 1 and not xr.is_spmd()


def install() -> None:
    global _installed
    if _installed:
        return
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    _orig.update(all_gather=xm.all_gather, reduce_scatter=xm.reduce_scatter, all_reduce=xm.all_reduce)

    def groups_or_all(groups):
        return groups or [list(range(xr.world_size()))]

    def all_gather(value, dim=0, groups=None, output=None, pin_layout=True, **_):
        if output is not None:
            raise NotImplementedError("shardcore CPU collectives: all_gather(output=) is not supported")
        if isinstance(value, list):
            return [all_gather(v, dim, groups) for v in value]
        return _orig["all_gather"](value, dim=dim, groups=groups_or_all(groups), pin_layout=False,
                                   channel_id=_next_id(), use_global_device_ids=True)

    def reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None, pin_layout=True, **_):
        if output is not None:
            raise NotImplementedError("shardcore CPU collectives: reduce_scatter(output=) is not supported")
        if isinstance(input, list):
            return [reduce_scatter(reduce_type, v, scale, scatter_dim, shard_count, groups) for v in input]
        return _orig["reduce_scatter"](reduce_type, input, scale, scatter_dim, shard_count, groups=groups_or_all(groups),
                                       pin_layout=False, channel_id=_next_id(), use_global_device_ids=True)

    def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
        def one(t: torch.Tensor) -> torch.Tensor:
            g = all_gather(t.unsqueeze(0), 0, groups)
            if reduce_type == xm.REDUCE_SUM:
                r = g.sum(0)
            elif reduce_type == xm.REDUCE_MAX:
                r = g.max(0).values
            elif reduce_type == xm.REDUCE_MIN:
                r = g.min(0).values
            else:
                raise NotImplementedError(f"shardcore CPU collectives: all_reduce {reduce_type!r}")
            return r * scale if scale != 1.0 else r

        if isinstance(inputs, torch.Tensor):
            return one(inputs)
        for t in inputs:
            t.copy_(one(t))
        return inputs

    xm.all_gather, xm.reduce_scatter, xm.all_reduce = all_gather, reduce_scatter, all_reduce
    _installed = True
