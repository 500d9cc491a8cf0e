"""Gathering each tensor of an export onto the one rank that writes it, many writers at a time.

``full_tensor()`` all-gathers: every rank of the mesh receives every tensor, so an export that ``W``
ranks write still moves ``W`` times the bytes any one of them needs, and on any interconnect the time
goes to that. Here the owner of a tensor's file receives it alone, from one holder of each distinct
block (a box of the tensor: offsets and sizes), and the units of a *round* (at most one unit per writer,
`rounds`) move at once as point-to-point sends and receives, so each rank receives about ``1/W`` of
the export. Blocks are computed from the DTensor's placements (``Shard(d)`` chunks as ``torch.chunk``
does, in mesh-dimension order; ``Replicate`` copies); of a block held by several ranks (HSDP's
replicas, TP's replicated tensors) the owner's own copy is used when it has one, else the copies take
turns by round. A tensor on a sub-mesh (FSDP's data-parallel mesh beside TP) has one copy of that
mesh per coordinate of the other dimensions, each seeing only its own ranks: the copy that holds the
owner serves it, the others send nothing. Tensors whose local part is not a box (``_StridedShard``,
from FSDP2 over TP, or ``Partial``) fall back to ``full_tensor()`` on every rank.

Written here rather than taken from torch because DTensor offers only all-gathers (``full_tensor``,
``redistribute``) and DCP's consolidation writes on one rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from automodel_modules import is_dtensor

__all__ = ["Block", "blocks_of", "gather_round", "rounds"]

Block = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of a tensor: its offsets and its sizes, one per dimension."""


def _chunk(start: int, size: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``index`` of ``parts`` of the extent ``[start, start + size)``."""
    step = math.ceil(size / parts) if size else 0
    lo = min(index * step, size)
    return start + lo, min(lo + step, size) - lo


def blocks_of(tensor: torch.Tensor) -> dict[Block, list[int]] | None:
    """The non-empty blocks of a DTensor and the global ranks holding each (None: not boxes).

    Each rank's local tensor is one block: the DTensor's ``Shard`` placements applied in mesh-dimension
    order to the global shape. None when a placement is neither ``Shard`` nor ``Replicate``.
    """
    from torch.distributed.tensor import Replicate, Shard

    placements = tensor.placements  # type: ignore[attr-defined]
    if not all(isinstance(p, Replicate) or type(p) is Shard for p in placements):
        return None
    ranks = tensor.device_mesh.mesh  # type: ignore[attr-defined]
    holders: dict[Block, list[int]] = {}
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        start, size = [0] * tensor.dim(), list(tensor.shape)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                d = placement.dim
                start[d], size[d] = _chunk(start[d], size[d], ranks.shape[mesh_dim], coord[mesh_dim])
        if 0 not in size:
            holders.setdefault((tuple(start), tuple(size)), []).append(int(ranks[coord]))
    return holders


def rounds(owners: Sequence[int]) -> list[range]:
    """Consecutive runs of units with distinct owners (the units of one run move at once)."""
    cuts, seen = [0], set[int]()
    for i, owner in enumerate(owners):
        if owner in seen:
            cuts.append(i)
            seen = set()
        seen.add(owner)
    cuts.append(len(owners))
    return [range(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _region(block: Block) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(*block, strict=True))


def _source(holders: list[int], owner: int, turn: int) -> int:
    """The rank a block is taken from: the owner's own copy when it holds one, else the copies in turn."""
    return owner if owner in holders else holders[turn % len(holders)]


def gather_round(
    needs: Sequence[tuple[int, Sequence[str]]],
    tensors: Mapping[str, torch.Tensor],
    me: int,
    group: dist.ProcessGroup | None,
    turn: int = 0,
) -> dict[int, dict[str, torch.Tensor]]:
    """Move whole tensors to their owners; every rank holding them calls this with the same ``needs``.

    Args:
        needs: Per unit of the round, its owner (global rank) and the model keys it reads.
        tensors: This rank's model tensors (DTensors where sharded, else the whole tensor).
        me: This rank's global rank.
        group: The group the sends and receives go through (ranks given as global ranks).
        turn: Which replica of a replicated block serves this round (alternates the replicas).

    Returns:
        For each unit index (into ``needs``) this rank owns, the whole tensors by model key.

    Collectives: ``full_tensor()`` over the mesh for each tensor that is not boxes (every rank, in
    ``needs`` order), then one ``batch_isend_irecv`` of every block that changes rank, waited on.
    """
    out: dict[int, dict[str, torch.Tensor]] = {}
    ops: list[Any] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination view, received buffer)
    with torch.no_grad():
        for index, (owner, keys) in enumerate(needs):
            whole = out.setdefault(index, {}) if owner == me else None
            for key in keys:
                t = tensors[key]
                blocks = blocks_of(t) if is_dtensor(t) else None
                full: torch.Tensor | None
                if blocks is None:
                    full = t.full_tensor() if is_dtensor(t) else t
                else:
                    full = _post_blocks(t, blocks, owner, me, turn, group, ops, copies)
                if whole is not None and full is not None:
                    whole[key] = full
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for view, buffer in copies:
            view.copy_(buffer)
    return out


def _post_blocks(
    t: torch.Tensor,
    blocks: Mapping[Block, list[int]],
    owner: int,
    me: int,
    turn: int,
    group: dist.ProcessGroup | None,
    ops: list[Any],
    copies: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor | None:
    """This rank's part in moving DTensor ``t`` onto ``owner``: its sends, or the owner's receives.

    Appends to ``ops`` the sends and receives to post and to ``copies`` the received buffers that are
    not views of the whole tensor (a block not contiguous in it); copies the owner's own block.

    Returns:
        On the owner, the whole tensor (filled once ``ops`` and ``copies`` are done); else None.
    """
    local = t.to_local()  # type: ignore[attr-defined]
    target = torch.empty(t.shape, dtype=t.dtype, device=local.device) if owner == me else None
    if target is None and not bool((t.device_mesh.mesh == owner).any()):  # type: ignore[attr-defined]
        return None  # a copy of this sub-mesh that holds the owner serves it
    for block, holders in sorted(blocks.items()):
        src = _source(holders, owner, turn)
        assert src != me or tuple(local.shape) == block[1], (block, tuple(local.shape))
        if src == me and target is not None:
            target[_region(block)] = local
        elif src == me:
            ops.append(dist.P2POp(dist.isend, local.contiguous(), owner, group))
        elif target is not None:
            view = target[_region(block)]
            buffer = view if view.is_contiguous() else torch.empty_like(view)
            ops.append(dist.P2POp(dist.irecv, buffer, src, group))
            if buffer is not view:
                copies.append((view, buffer))
    return target
