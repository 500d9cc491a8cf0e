"""Asynchronous (micro-pipelined) tensor parallelism: torch's inductor pass over symmetric memory.

With sequence parallelism every column-parallel matmul follows an all-gather of the sequence and every
row-parallel one precedes a reduce-scatter. Inductor's micro-pipelined TP pass rewrites each such pair,
in compiled code, into chunks whose communication overlaps the matmul of the previous chunk, through
symmetric memory on the TP group. Both halves are torch's; this module only turns them on, as torchtitan
does. Without compile the pass never runs, which is why `FSDP2Config` refuses async TP without
``enable_compile``.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["enable_async_tensor_parallel"]


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Enable symmetric memory on the ``tp`` group and inductor's micro-pipelined TP pass.

    Preconditions: a CUDA mesh (symmetric memory is CUDA-only); the TP plan uses sequence parallelism;
    the blocks are compiled afterwards (``FSDP2Config.enable_compile``). Mutates process-wide state:
    ``torch._inductor.config._micro_pipeline_tp`` is set for every later compilation, and the group is
    registered with torch's symmetric memory. No collective.
    """
    assert tp_mesh.device_type == "cuda", "async TP needs CUDA; FSDP2Manager refuses it elsewhere"
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
