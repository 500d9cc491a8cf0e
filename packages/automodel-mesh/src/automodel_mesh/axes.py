"""Mesh axis names shared by every automodel package.

The names are compatible with NeMo AutoModel, so code written against it finds the same axes here.
"Axis" always means a device-mesh axis; "dim" is kept for tensor dimensions.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["DENSE_AXES", "FLATTENED_AXES", "MOE_AXES", "MeshAxisName"]


class MeshAxisName(StrEnum):
    """Names of device-mesh axes.

    A `str` subclass (``StrEnum``): members compare equal to the plain strings
    (``MeshAxisName.TP == "tp"``), so they can be passed anywhere torch expects a mesh axis name.
    """

    PP = "pp"
    """Pipeline-parallel stages."""
    DP = "dp"
    """All data parallelism: ``dp_replicate x dp_shard`` (FSDP2 layout) or the plain ``dp`` axis."""
    DP_REPLICATE = "dp_replicate"
    """Replicas of HSDP (hybrid sharding): parameters are replicated across this axis."""
    DP_SHARD = "dp_shard"
    """FSDP sharding inside one replica."""
    DP_SHARD_CP = "dp_shard_cp"
    """``dp_shard x cp``: the axis FSDP shards over (context-parallel ranks also hold parameter shards)."""
    DP_CP = "dp_cp"
    """``dp_replicate x dp_shard x cp``: every rank that sees a different slice of the data or sequence."""
    CP = "cp"
    """Context (sequence) parallelism."""
    TP = "tp"
    """Tensor parallelism (and sequence parallelism on the same axis)."""
    EP = "ep"
    """Expert parallelism (MoE mesh)."""
    EP_SHARD = "ep_shard"
    """FSDP sharding of expert weights inside one expert-parallel group (MoE mesh)."""


DENSE_AXES: tuple[MeshAxisName, ...] = (
    MeshAxisName.PP,
    MeshAxisName.DP_REPLICATE,
    MeshAxisName.DP_SHARD,
    MeshAxisName.CP,
    MeshAxisName.TP,
)
"""Axes of the FSDP2 device mesh, outermost first."""

FLATTENED_AXES: dict[MeshAxisName, tuple[MeshAxisName, ...]] = {
    MeshAxisName.DP: (MeshAxisName.DP_REPLICATE, MeshAxisName.DP_SHARD),
    MeshAxisName.DP_SHARD_CP: (MeshAxisName.DP_SHARD, MeshAxisName.CP),
    MeshAxisName.DP_CP: (MeshAxisName.DP_REPLICATE, MeshAxisName.DP_SHARD, MeshAxisName.CP),
}
"""Flattened axes of the FSDP2 mesh and the axes each one spans."""

MOE_AXES: tuple[MeshAxisName, ...] = (MeshAxisName.PP, MeshAxisName.EP_SHARD, MeshAxisName.EP)
"""Axes of the MoE mesh, outermost first: the non-pipeline ranks regrouped as ``ep_shard x ep``."""
