"""A single-process reference that rounds as tensor parallelism does: each sharded linear split by hand.

In bf16, tensor parallelism is not transformers' bf16 computed elsewhere: a row-parallel linear adds
``tp`` partial products, each already rounded to bf16, where one matmul rounds once after accumulating in
fp32; in backward a column-parallel linear's input gradient is such a sum too. On a family whose bf16
error is already large, that extra rounding alone can exceed a bound drawn from transformers' own bf16
error. `split_like_tensor_parallel` makes the reference compute exactly those partial sums: every linear
that the sharded model holds as a ``tp``-sharded DTensor (``Shard(1)``: row-parallel, ``Shard(0)``:
column-parallel) runs on the reference as ``tp`` slices of its weight, summed (rows) or concatenated
(columns); autograd then forms the backward sums the same way. The comparison is then of the sharding
itself, not of bf16's rounding of a different sum.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from automodel_testing.numerics import normalize_fqn

__all__ = ["split_like_tensor_parallel"]


def _tp_split(module: nn.Module) -> tuple[int, int] | None:
    """``(dim of the weight split over tp, tp size)`` for a linear whose weight is tp-sharded, or None."""
    from torch.distributed.tensor import DTensor, Shard

    weight = getattr(module, "weight", None)
    if not isinstance(weight, DTensor) or not isinstance(module, nn.Linear):
        return None
    names = weight.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None
    placement = weight.placements[names.index("tp")]
    if not isinstance(placement, Shard) or placement.dim not in (0, 1):
        return None
    return placement.dim, weight.device_mesh.size(names.index("tp"))


def _split_forward(module: nn.Linear, dim: int, parts: int) -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        weights = module.weight.chunk(parts, dim=dim)
        if dim == 0:  # column-parallel: each slice computes its own output features
            biases = module.bias.chunk(parts) if module.bias is not None else [None] * parts
            return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)
        inputs = x.chunk(parts, dim=-1)  # row-parallel: partial products, each rounded, then added
        out = sum(
            (F.linear(i, w) for i, w in zip(inputs, weights, strict=True)), torch.zeros((), dtype=x.dtype)
        )
        return out + module.bias if module.bias is not None else out

    module.forward = forward  # type: ignore[method-assign,assignment]


def split_like_tensor_parallel(reference: nn.Module, sharded: Iterable[nn.Module]) -> list[str]:
    """Make ``reference``'s linears compute as the tensor-parallel ``sharded`` parts compute theirs.

    Each linear of ``sharded`` whose weight is a DTensor sharded over the ``tp`` mesh dimension gives
    the reference's linear of the same name (wrapper segments ignored) a forward over ``tp`` weight
    slices. Mutates ``reference`` (instance ``forward`` attributes); no collective. Returns the names of
    the linears split.
    """
    by_name = {normalize_fqn(name): module for name, module in reference.named_modules()}
    split: list[str] = []
    for part in sharded:
        for name, module in part.named_modules():
            found = _tp_split(module)
            target = by_name.get(normalize_fqn(name))
            if found is not None and isinstance(target, nn.Linear):
                _split_forward(target, *found)
                split.append(normalize_fqn(name))
    return split
