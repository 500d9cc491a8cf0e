"""automodel-mesh alone: build the FSDP2 mesh layout with TP 2 and read its sizes and groups.

torchrun --standalone --nproc-per-node 4 mesh_example.py     # gloo on CPU, nccl on GPUs
"""

import torch.distributed as dist

from automodel_mesh import MeshContext, MeshKind, ParallelismSizes

dist.init_process_group("gloo")
# The layout a strategy needs comes from the strategy (here its MeshKind); sizes are validated first,
# identically on every rank, so a bad layout raises the same ValueError everywhere.
ctx = MeshContext.build(MeshKind.FSDP2, ParallelismSizes(tp_size=2))
print(
    f"rank {dist.get_rank()}: dp_shard={ctx.dp_shard_size} tp={ctx.tp_size} "
    f"axes={ctx.device_mesh.mesh_dim_names} fsdp over {ctx.dp_axis_names()} "
    f"tp group ranks={dist.get_process_group_ranks(ctx.get_group('tp'))}"
)
dist.destroy_process_group()
