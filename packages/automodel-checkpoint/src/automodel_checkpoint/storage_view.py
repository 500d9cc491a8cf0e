"""DCP's view of a state dict: strided shards as the contiguous shards they are.

A DTensor placed ``_StridedShard(d, split_factor=s)`` on one mesh dimension (and nothing else on dim
``d``) holds, on each rank, ``s`` blocks
of dim ``d`` that are not next to each other in the global tensor: dim ``d`` is ``[s, m]`` with ``m``
cut over the ranks. peft's LoRA factor ``lora_B`` ``[out, r * E]`` of fused experts is such a tensor
under expert parallelism (column ``r_i * E + e``: `automodel_moe.experts`), and so are its optimizer
states. DCP describes a rank's part of a tensor as one box (offsets and sizes), which such a layout is
not: saving it fails with "overlapping chunks". Seen with dim ``d`` split in two, ``[..., s, m, ...]``,
the same local tensor is an ordinary ``Shard(d + 1)`` box: `storage_view` hands DCP that view (a view:
the same storage, so a load writes into the original tensor), and the files hold the tensor in that
shape, so a checkpoint saved on one expert-parallel size loads on another.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["storage_view"]


def _contiguous_box(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(value, DTensor):
        return value
    strided = [p for p in value.placements if isinstance(p, _StridedShard)]
    if len(strided) != 1:
        return value
    dim, split = strided[0].dim, int(strided[0].split_factor)
    others = [p for p in value.placements if isinstance(p, Shard) and not isinstance(p, _StridedShard)]
    if any(p.dim == dim for p in others):  # FSDP2 over TP's shards of the same dim: DCP reads those
        return value

    def moved(p: Any) -> Any:
        if p is strided[0]:
            return Shard(dim + 1)
        return Shard(p.dim + 1) if isinstance(p, Shard) and p.dim > dim else p

    local = value.to_local()
    assert value.shape[dim] % split == 0 and local.shape[dim] % split == 0, (value.shape, local.shape, split)
    shape = torch.Size((*value.shape[:dim], split, value.shape[dim] // split, *value.shape[dim + 1 :]))
    view = local.view(*local.shape[:dim], split, local.shape[dim] // split, *local.shape[dim + 1 :])
    stride = torch.empty(shape, device="meta").stride()
    placements = [moved(p) for p in value.placements]
    mesh = value.device_mesh
    return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape, stride=stride)


def storage_view(state: Any) -> Any:
    """``state`` (nested dicts and lists, as DCP takes) with every strided-shard DTensor as its box view.

    Other values are returned as they are; nothing is copied (see the module docstring).
    """
    if isinstance(state, dict):
        return {key: storage_view(value) for key, value in state.items()}
    if isinstance(state, list):
        return [storage_view(value) for value in state]
    if isinstance(state, torch.Tensor):
        return _contiguous_box(state)
    return state
