"""What a CUDA training process holds outside torch's caching allocator: its CUDA context and NCCL's buffers.

The memory model counts the tensors and what torch's caching allocator reserves around them
(``max_memory_reserved``, which the published peaks report). Each GPU rank also holds two things the
allocator never sees, and a job fits only if they fit beside it:

- the **CUDA context** (`CUDA_CONTEXT_BYTES`), once per process: the driver's state and the kernel
  images loaded into it. torch loads CUDA modules lazily (``CUDA_MODULE_LOADING=LAZY``, its default since
  1.13), so the context holds the kernels the job runs, not every kernel torch ships.
- **NCCL's buffers** (`nccl_buffer_bytes`): each process group a rank communicates over is an NCCL
  communicator, and each of its connections to a peer holds, on every channel, one FIFO per protocol
  (`NCCL_CONNECTION_BYTES`). A ring collective (all-gather, reduce-scatter, all-reduce) connects a rank
  to its predecessor on each channel; an all-to-all to every other rank of the group; a send/receive
  to its neighbours (one or two). NCCL opens `Device.nccl_channels` channels to a peer in the same node
  and `NCCL_CHANNELS_PER_NET_PEER` to one across the network. Send/receive connections are NCCL's
  own (its ``connIndex`` 1), apart from the collectives' on the same group.

Checked against the one published measurement there is: NVIDIA/nccl#1685, eight H100s in a node, an
all-to-all added 3.28 GB to each rank's NCCL memory; the model gives 7 peers x 32 channels x 9.19 MiB
= 2.16 GB: it under-counts that exchange by about a third (the issue's log shows allocations of 10 and
2 MiB per channel and peer, more than these defaults). Torch creates an NCCL communicator on its group's
first collective, so a group the job never communicates over costs nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from automodel_mesh import MeshLayout
from automodel_planner.estimate import PeakEstimate
from automodel_planner.hardware import Cluster

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "NCCL_CHANNELS_PER_NET_PEER",
    "NCCL_CONNECTION_BYTES",
    "nccl_buffer_bytes",
    "with_process_memory",
]

CUDA_CONTEXT_BYTES = 400 * 10**6
"""A torch process's CUDA context with lazy module loading: "around 400MB" (PyTorch's CUDA maintainer,
pytorch/pytorch#109888; torch's PR #86509, which made loading lazy, measured 287 MB for one tensor's
kernels, 667 MB loading every module). Not measured here: ``tools/gpu_check.sh`` records a lent GPU's
figure (``outside_allocator_bytes`` in its bench.json) for comparison."""

NCCL_CONNECTION_BYTES = 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 + (1 << 22)
"""One connection's FIFOs on one channel, NCCL's defaults (``src/init.cc``): LL (8 lines x 512 threads x
8 steps x 16 bytes: 512 KiB), LL128 (120 elements x 640 threads x 8 steps x 8 bytes: 4.69 MiB) and
Simple (``NCCL_BUFFSIZE``, 4 MiB): 9.19 MiB."""

NCCL_CHANNELS_PER_NET_PEER = 2
"""Channels NCCL opens to a peer across the network (``NCCL_NCHANNELS_PER_NET_PEER``'s default)."""


def _peer_channels(cluster: Cluster, size: int, stride: int, peers: int, ring: bool) -> int:
    """Channels a rank opens to ``peers`` of its group of ``size`` ranks ``stride`` apart.

    A ring reaches its predecessor on each of the communicator's channels (as many whether the ring
    stays in the node or not); the other patterns reach each peer in the node on the node's channels
    and each other one on the network's.
    """
    if ring:
        return cluster.device.nccl_channels
    near = min(peers, cluster.ranks_per_node(size, stride) - 1)
    return near * cluster.device.nccl_channels + (peers - near) * NCCL_CHANNELS_PER_NET_PEER


def nccl_buffer_bytes(groups: Mapping[str, frozenset[str]], layout: MeshLayout, cluster: Cluster) -> int:
    """Bytes of NCCL buffers one rank holds for the collectives it issues (see the module doc).

    Args:
        groups: Mesh axis -> the patterns of the rank's collectives over it (`PeakEstimate.groups`).
        layout: The job's mesh (group sizes and strides, `automodel_mesh.MeshLayout.group`).
        cluster: The hardware (channels per peer, GPUs per node).
    """
    total = 0
    for axis, patterns in groups.items():
        size, stride = (layout.world_size, 1) if axis == "world" else layout.group(axis)
        if axis == "pp":  # group() gives a neighbouring pair; a stage in the middle has two neighbours
            size = layout.pp
        if size < 2:
            continue
        for pattern in patterns:
            if pattern == "ring":
                channels = _peer_channels(cluster, size, stride, 1, ring=True)
            else:  # all_to_all: every other rank; p2p: the neighbours on both sides
                peers = size - 1 if pattern == "all_to_all" else min(size - 1, 2)
                channels = _peer_channels(cluster, size, stride, peers, ring=False)
            total += channels * NCCL_CONNECTION_BYTES
    return total


def with_process_memory(estimate: PeakEstimate, layout: MeshLayout, cluster: Cluster) -> PeakEstimate:
    """``estimate`` on ``cluster``'s GPUs: a new estimate with the CUDA context and NCCL's buffers as lines.

    Apply it after `automodel_planner.estimate.with_allocator_reserve` (whose reserve is a fraction of
    the tensors, which these two are not).
    """
    out = dataclasses.replace(estimate, lines=dict(estimate.lines), notes=dict(estimate.notes))
    out.lines["CUDA context"] = CUDA_CONTEXT_BYTES
    out.notes["CUDA context"] = "the driver's state and the kernels loaded, outside torch's allocator"
    nccl = nccl_buffer_bytes(estimate.groups, layout, cluster)
    if nccl:
        out.lines["NCCL buffers"] = nccl
        axes = ", ".join(sorted(estimate.groups))
        out.notes["NCCL buffers"] = f"a FIFO per protocol, channel and peer of each communicator: {axes}"
    return out
