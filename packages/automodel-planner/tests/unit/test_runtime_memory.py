"""The memory a GPU rank holds outside torch's allocator: its CUDA context and NCCL's buffers."""

from __future__ import annotations

import pytest

from automodel_mesh import MeshKind, MeshLayout, ParallelismSizes, resolve_layout
from automodel_planner.estimate import PeakEstimate
from automodel_planner.hardware import parse_cluster
from automodel_planner.runtime_memory import (
    CUDA_CONTEXT_BYTES,
    NCCL_CHANNELS_PER_NET_PEER,
    NCCL_CONNECTION_BYTES,
    nccl_buffer_bytes,
    with_process_memory,
)

_CONNECTION = NCCL_CONNECTION_BYTES


def _layout(world: int, kind: MeshKind = MeshKind.FSDP2, **sizes: int) -> MeshLayout:
    return resolve_layout(kind, ParallelismSizes(**sizes), world)


def test_each_pattern_connects_the_peers_nccl_connects() -> None:
    h100, a100 = parse_cluster("16xH100"), parse_cluster("16xA100")
    ring = frozenset({"ring"})
    # A ring reaches its predecessor on every channel: one connection's buffers per channel.
    fsdp = _layout(8)
    assert nccl_buffer_bytes({"dp_shard_cp": ring}, fsdp, h100) == 32 * _CONNECTION
    assert nccl_buffer_bytes({"dp_shard_cp": ring}, fsdp, a100) == 24 * _CONNECTION
    # A group of one rank connects to nobody; DDP's one group is the world.
    assert nccl_buffer_bytes({"tp": ring}, _layout(8, tp_size=1), h100) == 0
    assert nccl_buffer_bytes({"world": ring}, _layout(8, MeshKind.DDP), h100) == 32 * _CONNECTION
    # An all-to-all over 16 ranks on two nodes: 7 peers in the node, 8 across the network.
    ep = _layout(16, ep_size=16)
    near, far = 7 * 32, 8 * NCCL_CHANNELS_PER_NET_PEER
    assert nccl_buffer_bytes({"ep": frozenset({"all_to_all"})}, ep, h100) == (near + far) * _CONNECTION
    # A pipeline stage sends to its neighbours: one with two stages (a node apart here), two with more
    # (four stages 4 ranks apart: two to a node, so stage 1 has stage 0 beside it, stage 2 a node away).
    p2p = frozenset({"p2p"})
    two, four = _layout(16, pp_size=2), _layout(16, pp_size=4)
    assert nccl_buffer_bytes({"pp": p2p}, two, h100) == NCCL_CHANNELS_PER_NET_PEER * _CONNECTION
    assert nccl_buffer_bytes({"pp": p2p}, four, h100) == (32 + NCCL_CHANNELS_PER_NET_PEER) * _CONNECTION
    in_node = _layout(8, pp_size=4, tp_size=2)
    assert nccl_buffer_bytes({"pp": p2p}, in_node, h100) == 2 * 32 * _CONNECTION
    # Send/receive connections are NCCL's own, beside a group's collective ones.
    cp = _layout(8, cp_size=4)
    both = nccl_buffer_bytes({"cp": frozenset({"ring", "p2p"})}, cp, h100)
    assert both == nccl_buffer_bytes({"cp": ring}, cp, h100) + nccl_buffer_bytes({"cp": p2p}, cp, h100)


def test_an_all_to_all_in_a_node_against_the_published_measurement() -> None:
    # NVIDIA/nccl#1685: on eight H100s of a node, the first all-to-all added 3.28 GB of NCCL memory to
    # each rank. The defaults' FIFOs account for most of it (the module doc says what they leave out).
    modelled = nccl_buffer_bytes(
        {"ep": frozenset({"all_to_all"})}, _layout(8, ep_size=8), parse_cluster("8xH100")
    )
    assert modelled == pytest.approx(2.16e9, rel=0.01)
    assert 0.6 < modelled / 3.28e9 < 1.0


def test_the_lines_join_the_peak_and_one_gpu_has_no_nccl_line() -> None:
    estimate = PeakEstimate(rank="every rank", lines={"parameters": 10 * 2**30})
    estimate.groups["dp_shard_cp"] = frozenset({"ring"})
    on_gpus = with_process_memory(estimate, _layout(8), parse_cluster("8xH100"))
    assert on_gpus.lines == {
        "parameters": 10 * 2**30,
        "CUDA context": CUDA_CONTEXT_BYTES,
        "NCCL buffers": 32 * _CONNECTION,
    }
    assert estimate.lines == {"parameters": 10 * 2**30}, "the estimate given is left as it was"
    alone = with_process_memory(PeakEstimate(rank="every rank"), _layout(1), parse_cluster("1xH100"))
    assert alone.lines == {"CUDA context": CUDA_CONTEXT_BYTES}
