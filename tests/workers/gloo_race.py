"""``gloo_race.py ITERS [torch-default]`` (4 ranks): collectives in flight together on one gloo group.

Each step issues 8 functional all-gathers (what DTensor's redistribute runs) on one group of a 2 x 2
mesh before it waits for any, then checks every value. Two of them in flight keep both of a torch
gloo group's worker threads busy, which is what corrupts the heap (see
``shardcore.distributed.one_worker_gloo``). Every group must run one worker thread. ``torch-default``
keeps torch's two threads, to see the crash by hand; the test never passes it.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

from shardcore import distributed

IN_FLIGHT = 8


def main(iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = [dist.group.WORLD, mesh.get_group("dp"), mesh.get_group("tp")]
    threads = [distributed.gloo_threads(g) for g in groups]
    print(f"rank {dist.get_rank()}: gloo worker threads per group {threads}", flush=True)
    wrong = 0
    for it in range(iters):
        for dim in ("dp", "tp"):
            group, me = mesh.get_group(dim), mesh.get_local_rank(dim)
            ins = [torch.full((2,), float(it * 100 + j * 10 + me)) for j in range(IN_FLIGHT)]
            gathers = [funcol.all_gather_tensor(x, 0, group) for x in ins]
            for j, got in enumerate(gathers):
                want = [float(it * 100 + j * 10 + q) for q in range(2) for _ in range(2)]
                wrong += funcol.wait_tensor(got).tolist() != want
    dist.barrier()
    dist.destroy_process_group()
    assert wrong == 0, f"{wrong} collectives gave wrong values"
    assert threads == [1, 1, 1], threads


if __name__ == "__main__":
    if sys.argv[2:] == ["torch-default"]:
        from torch.distributed import ProcessGroupGloo

        ProcessGroupGloo.__init__ = distributed._GLOO_INIT
    main(int(sys.argv[1]))
