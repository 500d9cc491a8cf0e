"""Which slice of a global tensor a rank holds: per-dim index runs computed from DTensor placements.

A DTensor's local tensor is the global tensor cut by its placements, applied left to right over the
mesh axes. `Shard(d)` cuts dim ``d`` into ``mesh_size`` pieces with ``torch.chunk`` semantics (pieces
of ``ceil(n / mesh_size)``, the last ones short or empty). `_StridedShard(d, sf)` (what FSDP2 uses
over an already tensor-parallel dim) first cuts the dim into ``sf`` pieces, cuts each of those into
``mesh_size`` chunks, and gives a rank its chunk of every piece, concatenated. `Replicate` and
`Partial` leave the dim whole.

Because each placement cuts one tensor dim, the local tensor is always the product of one list of
global indices per dim. We keep those lists as *runs* (``(start, stop)`` ranges in local order): for
plain FSDP or TP a dim has one run; a strided shard can give several. `local_boxes` turns the runs
into boxes, each a contiguous block of the global tensor together with where it lands locally; the
loader reads exactly those bytes.

Pure functions of shapes and coordinates: no collectives, nothing mutated.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from automodel_modules import is_dtensor

__all__ = [
    "Box",
    "PlacementSpec",
    "chunk_runs",
    "local_boxes",
    "local_index_runs",
    "placement_specs",
    "tensor_boxes",
]

Run = tuple[int, int]
"""A half-open range ``[start, stop)`` of global indices along one tensor dim."""


@dataclass(frozen=True)
class PlacementSpec:
    """A placement reduced to what slicing needs.

    Attributes:
        kind: ``"shard"``, ``"strided_shard"`` or ``"replicate"`` (``Partial`` counts as replicate:
            every rank holds a full-shaped tensor).
        dim: The tensor dim a shard cuts (ignored for ``"replicate"``).
        split_factor: For ``"strided_shard"``, the number of pieces cut before this axis's chunks.
    """

    kind: str
    dim: int = 0
    split_factor: int = 1


@dataclass(frozen=True)
class Box:
    """A contiguous block of the global tensor and where it goes in the local tensor.

    Attributes:
        global_start: First global index per dim.
        local_start: First local index per dim.
        shape: Size per dim (the same globally and locally).
    """

    global_start: tuple[int, ...]
    local_start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        n = 1
        for size in self.shape:
            n *= size
        return n


def _chunk_bounds(length: int, num_chunks: int, index: int) -> Run:
    """Positions ``[a, b)`` of chunk ``index`` when ``length`` items are cut like ``torch.chunk``."""
    if num_chunks < 1:
        raise ValueError(f"cannot cut a dim into {num_chunks} chunks")
    size = -(-length // num_chunks) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def _take(runs: Sequence[Run], a: int, b: int) -> list[Run]:
    """The runs covering positions ``[a, b)`` of the concatenation of ``runs``."""
    out: list[Run] = []
    pos = 0
    for start, stop in runs:
        length = stop - start
        lo, hi = max(a, pos), min(b, pos + length)
        if lo < hi:
            out.append((start + lo - pos, start + hi - pos))
        pos += length
        if pos >= b:
            break
    return out


def _merge(runs: Sequence[Run]) -> list[Run]:
    """Join runs that continue each other (``(0, 4), (4, 8)`` -> ``(0, 8)``); drop empty ones."""
    out: list[Run] = []
    for start, stop in runs:
        if start == stop:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out


def chunk_runs(runs: Sequence[Run], num_chunks: int, index: int, split_factor: int = 1) -> list[Run]:
    """Apply one shard placement to the index runs of one dim.

    Args:
        runs: The dim's current global index runs, in local order.
        num_chunks: Size of the mesh axis.
        index: This rank's coordinate on that axis.
        split_factor: 1 for ``Shard``; the ``split_factor`` of a ``_StridedShard``.

    Returns:
        The runs this coordinate keeps, merged where they touch.
    """
    length = sum(stop - start for start, stop in runs)
    kept: list[Run] = []
    for piece in range(split_factor):
        p_start, p_stop = _chunk_bounds(length, split_factor, piece)
        c_start, c_stop = _chunk_bounds(p_stop - p_start, num_chunks, index)
        kept.extend(_take(runs, p_start + c_start, p_start + c_stop))
    return _merge(kept)


def local_index_runs(
    global_shape: Sequence[int],
    placements: Sequence[PlacementSpec],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> list[list[Run]]:
    """The global index runs of each tensor dim that make up one rank's local tensor.

    Args:
        global_shape: Shape of the global tensor.
        placements: One per mesh axis, outermost first.
        mesh_shape: Size of each mesh axis.
        coordinate: This rank's coordinate on each mesh axis.

    Returns:
        For each tensor dim, its runs in local order (an empty list for a dim this rank holds none of).

    Raises:
        ValueError: If the three sequences differ in length or a shard names a dim the tensor lacks.
    """
    if not len(placements) == len(mesh_shape) == len(coordinate):
        raise ValueError(
            f"placements {list(placements)}, mesh shape {list(mesh_shape)} and coordinate "
            f"{list(coordinate)} must have one entry per mesh axis"
        )
    runs: list[list[Run]] = [[(0, size)] if size else [] for size in global_shape]
    for spec, size, coord in zip(placements, mesh_shape, coordinate, strict=True):
        if spec.kind == "replicate":
            continue
        dim = spec.dim if spec.dim >= 0 else spec.dim + len(global_shape)
        if not 0 <= dim < len(global_shape):
            raise ValueError(f"placement {spec} shards dim {spec.dim} of a {len(global_shape)}-d tensor")
        split = spec.split_factor if spec.kind == "strided_shard" else 1
        runs[dim] = chunk_runs(runs[dim], size, coord, split)
    return runs


def local_boxes(runs: Sequence[Sequence[Run]]) -> list[Box]:
    """Cut the product of per-dim runs into boxes (one per combination of runs)."""
    if any(len(dim_runs) == 0 for dim_runs in runs):
        return []
    per_dim: list[list[tuple[Run, int]]] = []
    for dim_runs in runs:
        placed, offset = [], 0
        for start, stop in dim_runs:
            placed.append(((start, stop), offset))
            offset += stop - start
        per_dim.append(placed)
    boxes = []
    for combo in itertools.product(*per_dim):
        boxes.append(
            Box(
                global_start=tuple(run[0] for run, _ in combo),
                local_start=tuple(offset for _, offset in combo),
                shape=tuple(run[1] - run[0] for run, _ in combo),
            )
        )
    return boxes


def placement_specs(placements: Sequence[Any]) -> list[PlacementSpec]:
    """Translate DTensor placements into `PlacementSpec`s.

    Raises:
        ValueError: For a placement type this module does not know (the message names it).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    specs = []
    for placement in placements:
        if isinstance(placement, _StridedShard):
            specs.append(PlacementSpec("strided_shard", placement.dim, int(placement.split_factor)))
        elif isinstance(placement, Shard):
            specs.append(PlacementSpec("shard", placement.dim))
        elif isinstance(placement, Replicate | Partial):
            specs.append(PlacementSpec("replicate"))
        else:
            raise ValueError(
                f"cannot compute the local slice of placement {placement!r}; supported: Shard, "
                "_StridedShard, Replicate, Partial"
            )
    return specs


def tensor_boxes(tensor: torch.Tensor) -> tuple[tuple[int, ...], list[Box]]:
    """The global shape of ``tensor`` and the boxes of it this rank holds.

    A plain tensor is its own global tensor (one box). A DTensor is cut by its placements; a rank
    outside the DTensor's mesh holds nothing. No collectives.
    """
    if not is_dtensor(tensor):
        shape = tuple(tensor.shape)
        return shape, local_boxes([[(0, s)] if s else [] for s in shape])
    shape = tuple(tensor.shape)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return shape, []
    runs = local_index_runs(shape, placement_specs(tensor.placements), tuple(mesh.shape), coordinate)
    return shape, local_boxes(runs)
