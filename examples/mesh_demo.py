"""Build every mesh layout automodel knows on several CPU processes and print them.

Run with (4 processes, gloo on CPU):

    uv run --all-packages torchrun --standalone --nproc-per-node 4 examples/mesh_demo.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from automodel_mesh import MeshContext, MeshKind, ParallelismSizes


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    candidates = [
        (MeshKind.FSDP2, ParallelismSizes()),
        (MeshKind.FSDP2, ParallelismSizes(tp_size=2)),
        (MeshKind.FSDP2, ParallelismSizes(dp_replicate_size=2)),
        (MeshKind.FSDP2, ParallelismSizes(pp_size=2, ep_size=2)),
        (MeshKind.MEGATRON_FSDP, ParallelismSizes(cp_size=2)),
        (MeshKind.DDP, ParallelismSizes()),
        (MeshKind.FSDP2, ParallelismSizes(tp_size=3)),  # impossible on 2 or 4 ranks: shows the error
    ]
    for kind, sizes in candidates:
        try:
            ctx = MeshContext.build(kind, sizes)
        except ValueError as err:
            if rank == 0:
                print(f"\n{kind.value} {sizes}: rejected before any collective:\n  {err}")
            continue
        # Every rank reports its coordinates along each axis; rank 0 prints the table.
        coords = {axis: dist.get_process_group_ranks(ctx.get_group(axis)) for axis in ctx.axis_names()}
        gathered: list[dict[str, list[int]] | None] = [None] * world
        dist.all_gather_object(gathered, coords)
        if rank == 0:
            print(f"\n{kind.value} {sizes}\n{ctx.describe()}")
            for axis in ctx.axis_names():
                groups = sorted({tuple(g[axis]) for g in gathered if g is not None})
                print(f"  {axis:>12}: groups {[list(g) for g in groups]}")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"\nbuilt on {world} CPU process(es), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    main()
