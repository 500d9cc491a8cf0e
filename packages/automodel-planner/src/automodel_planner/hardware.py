"""Hardware as data: accelerators, their links, and clusters of them (``--cluster 128xH100``).

`DEVICES` holds each accelerator's datasheet figures: dense bf16 and fp8 peak FLOP/s (without
sparsity), HBM bandwidth, the memory torch reports, and the node it usually ships in (GPUs per node,
NVLink or PCIe bandwidth per GPU and direction, the scale-out network per GPU). A `Cluster` is a count
of one device; `parse_cluster` reads ``NxDEVICE``, `cluster_from_mapping` a user's own description
(the keys of `Device` and `Cluster`, e.g. from a small YAML file). Beside the peaks, the share of
them the best large matmul reaches on each part (``matmul_share``, ``fp8_matmul_share``: measured
ceilings, not a job's); what fraction of those ceilings a job reaches is
`automodel_planner.step_time.Efficiency`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from automodel_mesh import NodeFanout

__all__ = [
    "DEVICES",
    "NCCL_ALGORITHMS",
    "Cluster",
    "Device",
    "NcclAlgorithm",
    "cluster_from_mapping",
    "device_named",
    "parse_cluster",
]

_GB = 1e9
_MIB = 2**20
_US = 1e-6

# Maximum achievable matmul FLOP/s (MAMF: the best of a sweep of large bf16 or fp8 GEMM shapes, no
# sparsity), as stas00/ml-engineering measures it (compute/accelerator/README.md, "Maximum Achievable
# Matmul FLOPS comparison table"; its H200-vs-B200 guide for H200's and B200's fp8), over the datasheet
# peak: what a part's tensor cores sustain on the best shapes, which differs by part (A100 85.9%, H100
# 80.1%, B200 77.6%). A Hopper part without a measurement of its own (H100 PCIe, torchtitan's 500 W
# H100s) takes the H100 SXM's bf16 share and the H200's fp8 share (the same tensor cores).
_HOPPER_MATMUL_SHARE = 792.1 / 989.4
"""H100 SXM: 792.1 of 989 TFLOPS bf16 (CUDA 12.1)."""
_HOPPER_FP8_MATMUL_SHARE = 1453.4 / 1978.9
"""H200 SXM: 1,453.4 of 1,979 TFLOPS fp8."""


@dataclass(frozen=True)
class NcclAlgorithm:
    """One of NCCL's algorithms under one of its protocols, as NCCL's tuner models its time (microseconds)."""

    algorithm: str
    """``ring`` (every collective) or ``tree`` (all-reduce across nodes)."""
    protocol: str
    base: float
    """Latency of one operation, whatever its size."""
    nvlink_step: float
    """Latency of each step between two GPUs of a node joined by NVLink."""
    pcie_step: float
    """The same over PCIe."""
    network_step: float
    """Latency of each step that crosses the network."""
    lone_network_step: float
    """The same when each node holds one rank of the group: NCCL then takes the tree's for either
    algorithm (nothing inside a node hides the network's latency)."""
    bandwidth: float
    """Of the ring's bandwidth under the Simple protocol."""
    nvlink_only: bool = False
    """Run only inside NVLink nodes (NCCL enables LL128 by default only where every GPU's intra-node
    path is NVLink)."""


NCCL_ALGORITHMS: tuple[NcclAlgorithm, ...] = (
    NcclAlgorithm("ring", "Simple", 8.4, 3.4, 5.7, 14.0, 14.0, 1.0),
    NcclAlgorithm("ring", "LL128", 14.0, 1.9, 2.5, 4.0, 8.5, 120 / 128, nvlink_only=True),
    NcclAlgorithm("tree", "Simple", 8.4, 4.0, 4.0, 14.0, 14.0, 0.92),
    NcclAlgorithm("tree", "LL128", 14.0, 1.25, 1.9, 8.5, 8.5, 0.92 * 120 / 128, nvlink_only=True),
)
"""NCCL's ring and tree as its tuner models them (``ncclTunerConstantsDefaults`` and
``ncclTopoTuneModel`` in ``src/graph/tuning.cc``, NVIDIA/nccl 5067397, 2026-06): each one's base
latency, each step's latency on NVLink, PCIe and the network, and its bandwidth (LL128 moves 120 data
bytes in each 128; the tree's all-reduce reaches 0.92 of its links). NCCL gives each operation the
algorithm and protocol its model finds fastest; so does `Cluster.nccl_latency`. Left out: LL (half the
bandwidth, for messages of a few KiB: no collective of a training step is that small), NVLink SHARP and
CollNet (switch offload, where the fabric has it), PAT (one GPU per node), and NCCL's raising of a
multi-node ring's intra-node step to its network overhead (1 us, 3 under Simple, on Intel hosts), below
the steps here."""


@dataclass(frozen=True)
class Device:
    """One accelerator and the node it ships in (datasheet figures, per GPU)."""

    name: str
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    fp8_flops: float | None
    """Dense fp8 tensor-core peak, FLOP/s (None: no fp8 tensor cores)."""
    hbm_bytes_per_s: float
    memory_bytes: int
    """Total memory as ``torch.cuda.get_device_properties`` reports it."""
    intra_node_bytes_per_s: float
    """NVLink (or PCIe) bandwidth per GPU and direction inside a node."""
    gpus_per_node: int = 8
    inter_node_bytes_per_s: float = 50 * _GB
    """Scale-out network per GPU and direction (400 Gb/s InfiniBand or RoCE)."""
    nccl_channels: int = 32
    """Channels NCCL opens between two GPUs of a node, each with its own buffers
    (`automodel_planner.runtime_memory`): 32 on an NVSwitch node of H100s (NVIDIA/nccl#1685's log)."""
    nvlink: bool = True
    """The GPUs of a node are joined by NVLink (False: PCIe alone), which sets NCCL's per-step latency
    and whether it runs its LL128 protocol (`NCCL_ALGORITHMS`)."""
    matmul_share: float = _HOPPER_MATMUL_SHARE
    """Of ``bf16_flops``, what the best large bf16 matmul reaches on this part (its measured maximum
    achievable matmul FLOP/s over the peak); a device of one's own without a measurement takes the
    H100's."""
    fp8_matmul_share: float = _HOPPER_FP8_MATMUL_SHARE
    """The same of ``fp8_flops`` for fp8 matmuls."""
    sm_count: int = 132
    """Streaming multiprocessors (``torch.cuda.get_device_properties(...).multi_processor_count``; 132:
    the H100 SXM's and H200's, NVIDIA's H100 architecture whitepaper): a NCCL kernel holds one per
    channel while it runs (`automodel_planner.step_time`)."""
    source: str = ""

    def __post_init__(self) -> None:
        """Refuse figures the time and memory models divide by or take a share of (a cluster YAML's)."""
        rates = ("bf16_flops", "hbm_bytes_per_s", "memory_bytes", "intra_node_bytes_per_s")
        for name in (*rates, "inter_node_bytes_per_s", "gpus_per_node", "nccl_channels", "sm_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        for name in ("matmul_share", "fp8_matmul_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{name}: expected a share of the peak in (0, 1], got {value!r}")
        if not self.sm_count > self.nccl_channels:
            raise ValueError(
                f"sm_count: {self.sm_count!r} SMs cannot host the {self.nccl_channels} NCCL channels "
                "(nccl_channels) beside any compute; give the GPU's multi_processor_count"
            )


DEVICES: dict[str, Device] = {
    d.name.lower(): d
    for d in (
        Device(
            "H100",  # H100 SXM5 80 GB (HBM3), 700 W, 8 per HGX node on NVLink 4
            989.4e12,
            1978.9e12,
            3.35e12,
            81_559 * _MIB,
            450 * _GB,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOPS bf16, 1,979 fp8 (dense), "
            "3.35 TB/s, NVLink 900 GB/s",
        ),
        Device(
            "H100-PCIe",  # 80 GB HBM2e, 350 W, PCIe Gen5 x16 between GPUs
            756.5e12,
            1513e12,
            2.0e12,
            81_559 * _MIB,
            64 * _GB,
            nccl_channels=4,  # NCCL's log on GPUs joined by PCIe alone (NVIDIA/nccl#1706)
            nvlink=False,
            sm_count=114,  # NVIDIA H100 Tensor Core GPU Architecture whitepaper: 114 SMs on the PCIe part
            source="NVIDIA H100 datasheet (PCIe): 756 TFLOPS bf16, 1,513 fp8 (dense), 2 TB/s, "
            "PCIe Gen5 128 GB/s",
        ),
        Device(
            "H100-HBM2e-96G",  # the H100s of Meta's Grand Teton hosts that torchtitan benchmarks on
            # Its peak at the 500 W limit lies between the SXM and NVL parts (torchtitan does not know
            # it either); the NVL part's 835 TFLOPS is the one taken.
            835e12,
            1671e12,
            2.4e12,
            95_830 * _MIB,
            450 * _GB,
            source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e, 2.4 TB/s, 500 W, "
            "8 per host on NVLink, 400 Gb/s RDMA per GPU; peak: H100 NVL datasheet (835 TFLOPS bf16)",
        ),
        Device(
            "H200",  # H200 SXM 141 GB (HBM3e), same compute as the H100 SXM
            989.4e12,
            1978.9e12,
            4.8e12,
            143_771 * _MIB,
            450 * _GB,
            matmul_share=794.5 / 989.4,  # ml-engineering's H200-vs-B200 guide: 794.5 TFLOPS bf16
            source="NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16, 1,979 fp8 (dense), 4.8 TB/s, "
            "NVLink 900 GB/s",
        ),
        Device(
            "B200",  # HGX B200, 180 GB HBM3e per GPU, NVLink 5
            2.25e15,
            4.5e15,
            8.0e12,
            183_359 * _MIB,
            900 * _GB,
            sm_count=148,  # the device properties CUDA reports (pytorch/ao#4002)
            matmul_share=1745.0 / 2250,  # ml-engineering: 1,745 TFLOPS bf16, 3,432.5 fp8 measured
            fp8_matmul_share=3432.5 / 4500,
            source="NVIDIA HGX B200 datasheet: 2.25 PFLOPS bf16, 4.5 fp8 (dense) per GPU, 8 TB/s, "
            "NVLink 1.8 TB/s",
        ),
        Device(
            "A100",  # A100 SXM4 80 GB, NVLink 3; no fp8 tensor cores
            312e12,
            None,
            2.039e12,
            81_251 * _MIB,
            300 * _GB,
            nccl_channels=24,  # NCCL's log on NVLink A100s (NVIDIA/nccl#1785)
            sm_count=108,  # NVIDIA A100 Tensor Core GPU Architecture whitepaper
            matmul_share=267.9 / 312,  # ml-engineering's MAMF table: 267.9 TFLOPS bf16 (CUDA 12.1)
            source="NVIDIA A100 datasheet (80 GB SXM): 312 TFLOPS bf16 (dense), 2,039 GB/s, NVLink 600 GB/s",
        ),
    )
}
"""Lower-cased name -> device. ``H100`` is the SXM part."""

_ALIASES = {"h100-sxm": "h100", "h100-80g": "h100", "a100-80g": "a100", "h200-sxm": "h200"}


@dataclass(frozen=True)
class Cluster:
    """``count`` GPUs of one `Device`, ``gpus_per_node`` to a node."""

    device: Device
    count: int
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        """Nodes the GPUs fill (the last one may be partly used)."""
        return -(-self.count // self.gpus_per_node)

    def ranks_per_node(self, size: int, stride: int) -> int:
        """How many of a group's ``size`` ranks, ``stride`` global ranks apart, share a node.

        Groups are taken to start at a node boundary.
        """
        return max(1, min(size, self.gpus_per_node // stride)) if stride <= self.gpus_per_node else 1

    def seconds(
        self, sent: float, pattern: str, size: int, stride: int, fanout: NodeFanout | None = None
    ) -> float:
        """Seconds one rank takes to send ``sent`` bytes in a collective of ``size`` ranks ``stride`` apart.

        At full link speed (the caller applies NCCL's efficiency). A group inside one node runs on
        NVLink. Across nodes, with ``m`` of its ranks in each node: a ring collective (``sent`` is a
        rank's ``(n - 1) / n`` share of the whole) runs as ``m`` rings, one per network link, and every
        chunk but one passes each ring's way into a node, so each link carries ``sent / m`` (NCCL runs
        all-gather and reduce-scatter as rings) while NVLink carries ``sent``: the slower counts; an
        all-to-all sends the share bound off-node over the rank's own link; a send to a neighbour uses
        the network when the group leaves the node; an all-to-all with a ``fanout`` (`NodeFanout`:
        once per destination node, forwarded inside it) puts all of ``sent`` on NVLink and its network
        share on the rank's link. Groups are taken to start at a node boundary.
        """
        intra, inter = self.device.intra_node_bytes_per_s, self.device.inter_node_bytes_per_s
        per_node = self.ranks_per_node(size, stride)
        nodes = -(-size // per_node)
        if nodes == 1 or size < 2:
            return sent / intra
        if pattern == "p2p":
            return sent / inter
        if pattern == "all_to_all" and fanout is not None:
            return max(sent * fanout.network_share(per_node) / inter, sent / intra)
        if pattern == "all_to_all":
            off_node = sent * (size - per_node) / (size - 1)
            return max(off_node / inter, (sent - off_node) / intra)
        return max(sent / (per_node * inter), sent / intra if per_node > 1 else 0.0)

    def nccl_latency(self, size: int, stride: int, transfer: float, all_reduce: bool = False) -> float:
        """Seconds NCCL's latency adds to one operation over ``size`` ranks ``stride`` apart.

        A ring on ``N`` nodes runs ``size - 1`` steps for an all-gather or a reduce-scatter (twice that
        for an all-reduce), ``N - 1`` (twice) of them across the network; an all-reduce across nodes may
        instead run as a tree: a chain through each node's ranks and ``log2 N`` network levels, down and
        up. ``transfer``: the operation's seconds on the ring under the Simple protocol. NCCL picks what
        its model finds fastest (`NCCL_ALGORITHMS`: latency plus transfer at that choice's bandwidth);
        the result is that time less ``transfer``.
        """
        if size < 2:
            return 0.0
        per_node = self.ranks_per_node(size, stride)
        nodes = -(-size // per_node)
        rounds = 2 if all_reduce else 1
        best = float("inf")
        for choice in NCCL_ALGORITHMS:
            if choice.nvlink_only and not self.device.nvlink:
                continue
            local = choice.nvlink_step if self.device.nvlink else choice.pcie_step
            network = choice.network_step if per_node > 1 else choice.lone_network_step
            if choice.algorithm == "ring":
                crossings = rounds * (nodes - 1)
                steps = (rounds * (size - 1) - crossings) * local + crossings * network
                seconds = transfer
            elif all_reduce and nodes > 1:
                steps = 2 * ((per_node - 1) * local + int(math.log2(nodes)) * network)
                seconds = transfer * size / (size - 1)  # sends the whole buffer, not a ring's share
            else:
                continue
            best = min(best, (choice.base + steps) * _US + seconds / choice.bandwidth)
        return best - transfer

    def describe(self) -> str:
        """``8 x H100 (1 node of 8)``."""
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return f"{self.count} x {self.device.name} ({nodes} of {self.gpus_per_node})"


def _device(name: str) -> Device:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        known = ", ".join(d.name for d in DEVICES.values())
        raise ValueError(f"unknown device {name!r}: expected one of {known}, or describe it in a cluster")
    return DEVICES[key]


_REPORTED_NAMES = (
    ("h100 pcie", "h100-pcie"),
    ("h100 80gb hbm3", "h100"),
    ("h100 sxm", "h100"),
    ("h200", "h200"),
    ("b200", "b200"),
    ("a100-sxm4-80gb", "a100"),
    ("a100 80gb", "a100"),
)
"""Substrings of the names CUDA reports (``torch.cuda.get_device_name``) -> `DEVICES` keys. Only names
whose datasheet figures are those of the entry: an H100 NVL or a 40 GB A100 match none."""


def device_named(reported: str) -> Device | None:
    """The `DEVICES` entry of the GPU CUDA reports as ``reported`` (None: not in the table)."""
    name = reported.lower()
    return next((DEVICES[key] for part, key in _REPORTED_NAMES if part in name), None)


def parse_cluster(text: str) -> Cluster:
    """``128xH100`` (or ``128 x h100``): that many GPUs of a `DEVICES` entry, in its usual nodes.

    Raises:
        ValueError: Not ``NxDEVICE``, a count below 1, or an unknown device (the message lists them).
    """
    match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*([\w.-]+)\s*", text)
    if match is None:
        raise ValueError(f"{text!r}: expected GPUs x device, such as 8xH100 or 128xH200")
    count = int(match.group(1))
    if count < 1:
        raise ValueError(f"{text!r}: the GPU count must be at least 1")
    device = _device(match.group(2))
    return Cluster(device, count, device.gpus_per_node)


_DEVICE_FIELDS = {f.name for f in dataclasses.fields(Device)}
_CLUSTER_KEYS = {"gpus", "device", "gpus_per_node", "intra_node_bytes_per_s", "inter_node_bytes_per_s"}
_CLUSTER_KEYS |= {"inter_node_gbps"}


def cluster_from_mapping(data: Mapping[str, Any]) -> Cluster:
    """A cluster of one's own: ``{gpus: 64, device: H100, gpus_per_node: 8, inter_node_gbps: 200}``.

    ``device`` names a `DEVICES` entry or is a mapping of `Device` fields (``name``, ``bf16_flops``, ...);
    the top-level keys ``gpus_per_node``, ``intra_node_bytes_per_s`` and ``inter_node_bytes_per_s`` (or
    ``inter_node_gbps``, in gigabits per second) override the device's node.

    Raises:
        ValueError: A missing or unknown key, or a value of the wrong kind, named.
    """
    unknown = set(data) - _CLUSTER_KEYS
    if unknown:
        raise ValueError(f"cluster: unknown key(s) {sorted(unknown)}")
    if not isinstance(data.get("gpus"), int) or data["gpus"] < 1:
        raise ValueError("cluster.gpus: expected the number of GPUs (an int >= 1)")
    spec = data.get("device")
    if isinstance(spec, str):
        device = _device(spec)
    elif isinstance(spec, Mapping):
        bad = set(spec) - _DEVICE_FIELDS
        if bad:
            fields = sorted(_DEVICE_FIELDS)
            raise ValueError(f"cluster.device: unknown field(s) {sorted(bad)}; known fields: {fields}")
        try:
            device = Device(**spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cluster.device: {exc}") from None
    else:
        raise ValueError("cluster.device: expected a device name (H100, ...) or a mapping of Device fields")
    overrides: dict[str, Any] = {}
    if "inter_node_gbps" in data:
        overrides["inter_node_bytes_per_s"] = float(data["inter_node_gbps"]) * 1e9 / 8
    for key in ("gpus_per_node", "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
        if key in data:
            overrides[key] = data[key]
    try:
        device = dataclasses.replace(device, **overrides)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cluster.{exc}") from None
    return Cluster(device, data["gpus"], device.gpus_per_node)
