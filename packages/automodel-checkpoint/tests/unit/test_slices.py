"""Offsets of the local slice of a DTensor for each placement, against an independent simulation."""

from __future__ import annotations

import itertools

import pytest
import torch

from automodel_checkpoint.slices import (
    Box,
    PlacementSpec,
    chunk_runs,
    local_boxes,
    local_index_runs,
    placement_specs,
    tensor_boxes,
)

SHARD0 = PlacementSpec("shard", 0)
SHARD1 = PlacementSpec("shard", 1)
REPLICATE = PlacementSpec("replicate")


def _simulate(
    shape: tuple[int, ...], specs: list[PlacementSpec], mesh: tuple[int, ...], coord: tuple[int, ...]
):
    """The local tensor of a global arange, cut with torch.chunk as DTensor's docs describe."""
    local = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for spec, size, c in zip(specs, mesh, coord, strict=True):
        if spec.kind == "replicate":
            continue
        if spec.kind == "shard":
            chunks = list(torch.chunk(local, size, dim=spec.dim))
            local = chunks[c] if c < len(chunks) else local.narrow(spec.dim, 0, 0)
            continue
        pieces = list(torch.chunk(local, spec.split_factor, dim=spec.dim))
        parts = []
        for piece in pieces:
            chunks = list(torch.chunk(piece, size, dim=spec.dim))
            parts.append(chunks[c] if c < len(chunks) else piece.narrow(spec.dim, 0, 0))
        local = torch.cat(parts, dim=spec.dim)
    return local


def _from_boxes(shape: tuple[int, ...], boxes: list[Box], local_shape: tuple[int, ...]) -> torch.Tensor:
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    out = torch.full(local_shape, -1, dtype=full.dtype)
    for box in boxes:
        g = tuple(slice(s, s + n) for s, n in zip(box.global_start, box.shape, strict=True))
        lo = tuple(slice(s, s + n) for s, n in zip(box.local_start, box.shape, strict=True))
        out[lo] = full[g]
    return out


LAYOUTS = {
    "fsdp4": ([SHARD0], (4,)),
    "fsdp4-dim1": ([SHARD1], (4,)),
    "hsdp2x2": ([REPLICATE, SHARD0], (2, 2)),
    "tp2-colwise": ([SHARD0], (2,)),
    "tp2-rowwise": ([SHARD1], (2,)),
    "tp2xfsdp2": ([PlacementSpec("strided_shard", 0, 2), SHARD0], (2, 2)),
    "tp2xfsdp2-rowwise": ([SHARD0, SHARD1], (2, 2)),
    "tp4xfsdp2-strided": ([PlacementSpec("strided_shard", 0, 4), SHARD0], (2, 4)),
    "fsdp8": ([SHARD0], (8,)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", [(8, 6), (10, 3), (130, 4), (3, 5), (5,), (2, 7)])
def test_boxes_match_simulated_placements(layout: str, shape: tuple[int, ...]) -> None:
    specs, mesh = LAYOUTS[layout]
    if any(s.dim >= len(shape) for s in specs if s.kind != "replicate"):
        pytest.skip("placement dim beyond the tensor")
    for coord in itertools.product(*(range(m) for m in mesh)):
        expected = _simulate(shape, specs, mesh, coord)
        boxes = local_boxes(local_index_runs(shape, specs, mesh, coord))
        assert sum(b.numel for b in boxes) == expected.numel(), (layout, coord)
        assert torch.equal(_from_boxes(shape, boxes, tuple(expected.shape)), expected), (layout, coord)


def test_strided_shard_matches_dtensor_split() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    t = torch.arange(130)
    for coord in range(4):
        (spec,) = placement_specs([_StridedShard(0, split_factor=2)])
        runs = local_index_runs((130,), [spec], (4,), (coord,))
        shards, _ = _StridedShard(0, split_factor=2)._split_tensor(t, 4, with_padding=False)
        expected = shards[coord]
        got = torch.cat([t[a:b] for a, b in runs[0]]) if runs[0] else t[:0]
        assert torch.equal(got, expected)


def test_chunk_runs_follow_torch_chunk() -> None:
    assert chunk_runs([(0, 10)], 4, 0) == [(0, 3)]
    assert chunk_runs([(0, 10)], 4, 3) == [(9, 10)]
    assert chunk_runs([(0, 3)], 4, 3) == []  # torch.chunk gives 3 chunks; the 4th rank holds nothing
    assert chunk_runs([(0, 4), (8, 12)], 2, 1) == [(8, 12)]
    assert chunk_runs([(0, 8)], 2, 1, split_factor=2) == [(2, 4), (6, 8)]
    assert chunk_runs([(0, 4), (4, 8)], 1, 0) == [(0, 8)]  # touching runs merge


def test_placement_specs_and_errors() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    specs = placement_specs([Shard(1), Replicate(), Partial(), _StridedShard(0, split_factor=3)])
    assert specs == [SHARD1, REPLICATE, REPLICATE, PlacementSpec("strided_shard", 0, 3)]
    with pytest.raises(ValueError, match="supported"):
        placement_specs([object()])
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        local_index_runs((4,), [SHARD0], (2, 2), (0, 0))
    with pytest.raises(ValueError, match="shards dim 2"):
        local_index_runs((4, 4), [PlacementSpec("shard", 2)], (2,), (0,))


def test_plain_tensor_is_one_box() -> None:
    shape, boxes = tensor_boxes(torch.zeros(3, 4))
    assert shape == (3, 4)
    assert boxes == [Box((0, 0), (0, 0), (3, 4))]
    assert tensor_boxes(torch.zeros(0, 4))[1] == []
    assert tensor_boxes(torch.tensor(1.0))[1] == [Box((), (), ())]
