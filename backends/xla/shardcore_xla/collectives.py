"""How the ranks of an XLA run meet, in each of its three set-ups:

* SPMD (``xla_fsdp_v2: true``): one controller drives every device; a value is already global, so
  every collective is the identity and there is one rank;
* XLA FSDP on several CPU devices: the ranks are device threads of one process, meeting in Python
  (:class:`cpu.DeviceThreads`): torch_xla's CPU collectives meet only when every device runs the same
  compiled module, which the objects and tensors exchanged here would not give;
* XLA FSDP elsewhere (TPU): one device per process, torch_xla's own collectives.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from . import cpu


@dataclass(frozen=True)
class Ranks:
    spmd: bool
    threads: cpu.DeviceThreads | None

    def rank(self) -> int:
        import torch_xla.runtime as xr

        return 0 if self.spmd else xr.global_ordinal()

    def size(self) -> int:
        import torch_xla.runtime as xr

        return 1 if self.spmd else xr.world_size()

    def sync(self) -> None:
        """Cut and run the pending lazy graph; on several CPU devices the device threads take turns,
        so that all run one compiled module."""
        import torch_xla

        if self.threads is not None:
            self.threads.sync()
        else:
            torch_xla.sync()

    def barrier(self) -> None:
        import torch_xla.core.xla_model as xm

        if self.threads is not None:
            self.threads.wait()
        elif not self.spmd:
            xm.rendezvous("shardcore.barrier")

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks. Under SPMD a value is already global, so this is the identity."""
        import torch_xla.core.xla_model as xm

        if self.size() == 1:
            return tensor
        if self.threads is not None:
            parts = self.threads.gather_cpu(self.rank(), tensor)
            return torch.stack(parts).sum(0).to(tensor.device)
        return xm.all_reduce(xm.REDUCE_SUM, tensor)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank. Collective."""
        import torch_xla.core.xla_model as xm

        if self.size() == 1:
            return obj
        if self.threads is not None:
            return self.threads.exchange(self.rank(), obj)[0]
        payload = pickle.dumps(obj) if self.rank() == 0 else b""
        return pickle.loads(xm.rendezvous("shardcore.broadcast_object", payload)[0])

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank. Collective."""
        import torch_xla.core.xla_model as xm

        if self.size() == 1:
            return [obj]
        if self.threads is not None:
            return self.threads.exchange(self.rank(), obj)
        return [pickle.loads(b) for b in xm.rendezvous("shardcore.all_gather_object", pickle.dumps(obj))]

    def all_gather_dim0(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 (XLA FSDP shards, rank after rank)."""
        import torch_xla.core.xla_model as xm

        if self.threads is not None:
            return torch.cat(self.threads.gather_cpu(self.rank(), tensor))
        if self.size() > 1:
            return xm.all_gather(tensor.detach(), dim=0)
        return tensor

    def broadcast_tensors(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's tensors (the other ranks pass ``{}``) on every rank, on CPU. Collective."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        if self.size() == 1:
            return state_dict
        if self.threads is not None:
            return self.threads.exchange(self.rank(), state_dict)[0]  # read-only on the others
        meta = self.broadcast_object({k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()})
        out = {}
        for k, (shape, dtype) in meta.items():
            t = state_dict[k] if k in state_dict else torch.zeros(shape, dtype=dtype)
            # only rank 0 contributes non-zeros, so a sum is a broadcast
            out[k] = xm.all_reduce(xm.REDUCE_SUM, t.to(torch_xla.device())).cpu()
        return out
