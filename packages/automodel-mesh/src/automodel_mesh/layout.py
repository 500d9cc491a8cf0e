"""Pure mesh-layout resolution: sizes in, validated layout out, no process groups.

Everything that can be wrong with a requested layout is detected here, before any collective runs, so
a bad configuration raises the same `ValueError` on every rank instead of hanging one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from automodel_mesh.axes import DENSE_AXES, FLATTENED_AXES, MOE_AXES, MeshAxisName
from automodel_mesh.sizes import ParallelismSizes

__all__ = ["MeshKind", "MeshLayout", "MeshStrategy", "mesh_kind_of", "resolve_layout"]


class MeshKind(StrEnum):
    """The device-mesh layout a parallelisation strategy needs."""

    FSDP2 = "fsdp2"
    """``(pp, dp_replicate, dp_shard, cp, tp)`` with flattened ``dp``, ``dp_shard_cp``, ``dp_cp``, and a
    MoE mesh ``(pp, ep_shard, ep)`` when ``ep > 1``. Supports every parallelism."""
    MEGATRON_FSDP = "megatron_fsdp"
    """``(dp, cp, tp)`` with flattened ``dp_cp``. No pipeline, expert parallelism or HSDP."""
    DDP = "ddp"
    """No device mesh: plain data parallelism over the process group."""


@runtime_checkable
class MeshStrategy(Protocol):
    """What `MeshContext.build` needs to know about a strategy config.

    Strategy configs (``FSDP2Config`` and friends, in automodel-distributed) implement it, so this
    package never imports them.
    """

    def mesh_kind(self) -> MeshKind:
        """Return the mesh layout this strategy shards over."""
        ...


def mesh_kind_of(strategy: MeshStrategy | MeshKind | str) -> MeshKind:
    """Return the `MeshKind` of a strategy config, a `MeshKind`, or its string value.

    Raises:
        ValueError: ``strategy`` is none of these; the message says how to make it one.
    """
    if isinstance(strategy, MeshKind):
        return strategy
    if isinstance(strategy, str):
        try:
            return MeshKind(strategy.lower())
        except ValueError:
            known = [k.value for k in MeshKind]
            raise ValueError(
                f"strategy_config={strategy!r} is not a known mesh kind; use one of {known}"
            ) from None
    if isinstance(strategy, MeshStrategy):
        kind = strategy.mesh_kind()
        if not isinstance(kind, MeshKind):
            raise ValueError(
                f"{type(strategy).__name__}.mesh_kind() returned {kind!r}; it must return an "
                "automodel_mesh.MeshKind"
            )
        return kind
    raise ValueError(
        f"strategy_config of type {type(strategy).__name__} does not say which mesh it needs: pass an "
        "FSDP2Config / MegatronFSDPConfig / DDPConfig, a MeshKind, or an object with a mesh_kind() method"
    )


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """A validated mesh layout: every size is final and the product equals ``world_size``."""

    kind: MeshKind
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    ep_shard: int = 1

    @property
    def dp(self) -> int:
        """Total data-parallel degree ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """Size of the FSDP sharding axis ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """Size of ``dp x cp``."""
        return self.dp * self.cp

    @property
    def shards_parameters(self) -> bool:
        """Whether some rank holds only part of the parameters: a ``pp``, ``tp``, ``ep`` or FSDP axis > 1."""
        return self.pp > 1 or self.tp > 1 or self.ep > 1 or self.dp_shard_cp > 1

    @property
    def has_device_mesh(self) -> bool:
        """Whether this layout builds a device mesh (DDP uses the process group only)."""
        return self.kind is not MeshKind.DDP

    @property
    def has_moe_mesh(self) -> bool:
        """Whether this layout builds a MoE mesh (expert parallelism on)."""
        return self.ep > 1

    def dense_shape(self) -> tuple[tuple[MeshAxisName, int], ...]:
        """The dense device mesh as ``(axis, size)`` pairs, outermost first (empty for DDP)."""
        if self.kind is MeshKind.FSDP2:
            sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
            return tuple(zip(DENSE_AXES, sizes, strict=True))
        if self.kind is MeshKind.MEGATRON_FSDP:
            return ((MeshAxisName.DP, self.dp), (MeshAxisName.CP, self.cp), (MeshAxisName.TP, self.tp))
        return ()

    def flattened_axes(self) -> dict[MeshAxisName, tuple[MeshAxisName, ...]]:
        """Flattened axes built on top of the dense mesh and the axes each one spans."""
        if self.kind is MeshKind.FSDP2:
            return dict(FLATTENED_AXES)
        if self.kind is MeshKind.MEGATRON_FSDP:
            return {MeshAxisName.DP_CP: (MeshAxisName.DP, MeshAxisName.CP)}
        return {}

    def moe_shape(self) -> tuple[tuple[MeshAxisName, int], ...]:
        """The MoE mesh as ``(axis, size)`` pairs (empty when ``ep == 1``)."""
        if not self.has_moe_mesh:
            return ()
        return tuple(zip(MOE_AXES, (self.pp, self.ep_shard, self.ep), strict=True))

    def group(self, axis: MeshAxisName | str) -> tuple[int, int]:
        """``(size, stride)`` of one group of ``axis``: its ranks are ``stride`` global ranks apart.

        Ranks are laid out row-major over `dense_shape` (`moe_shape` for ``ep`` / ``ep_shard``); a
        flattened axis has its innermost part's stride. ``pp``'s group is a pair of neighbouring stages.
        Under DDP (no mesh) every axis is the whole world, stride 1. A planner places the group on
        nodes from these two numbers (``automodel_planner.Cluster.seconds``).

        Raises:
            ValueError: ``axis`` is not an axis of this layout.
        """
        name = MeshAxisName(axis)
        shape = self.moe_shape() if name in (MeshAxisName.EP, MeshAxisName.EP_SHARD) else self.dense_shape()
        if not shape:
            return self.world_size, 1
        axes = self.flattened_axes().get(name, (name,))
        sizes = dict(shape)
        if any(a not in sizes for a in axes):
            raise ValueError(f"axis {name.value!r} is not an axis of this {self.kind.value} layout")
        order = [a for a, _ in shape]
        innermost = max(axes, key=order.index)
        stride = math.prod(size for _, size in shape[order.index(innermost) + 1 :])
        size = math.prod(sizes[a] for a in axes)
        return (min(size, 2), stride) if name is MeshAxisName.PP else (size, stride)

    def describe(self) -> str:
        """One line per mesh, e.g. ``dense (pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2)``."""

        def fmt(shape: tuple[tuple[MeshAxisName, int], ...]) -> str:
            return ", ".join(f"{axis.value}={size}" for axis, size in shape)

        lines = [f"{self.kind.value} layout over {self.world_size} rank(s)"]
        if self.has_device_mesh:
            lines.append(f"  dense mesh ({fmt(self.dense_shape())})")
            flat = ", ".join(
                f"{name.value}={'*'.join(a.value for a in axes)}"
                for name, axes in self.flattened_axes().items()
            )
            lines.append(f"  flattened  ({flat})")
        else:
            lines.append(f"  no device mesh: data parallel over {self.world_size} rank(s)")
        if self.has_moe_mesh:
            lines.append(f"  moe mesh   ({fmt(self.moe_shape())})")
        return "\n".join(lines)


def _product(names: str, values: tuple[int, ...]) -> str:
    return f"{names} = {' * '.join(str(v) for v in values)} = {_mul(values)}"


def _mul(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _ddp_layout(sizes: ParallelismSizes, dp_replicate: int, world_size: int) -> MeshLayout:
    """DDP's layout: every rank a replica; any other degree is refused (it needs a device mesh)."""
    for name in ("tp_size", "pp_size", "cp_size", "ep_size"):
        if getattr(sizes, name) > 1:
            raise ValueError(
                f"ParallelismSizes.{name}={getattr(sizes, name)} needs a device mesh, but DDP has none: "
                "use FSDP2Config for tensor, pipeline, context or expert parallelism"
            )
    if dp_replicate > 1:
        raise ValueError(
            f"ParallelismSizes.dp_replicate_size={dp_replicate} is HSDP, which only FSDP2Config "
            "supports; DDP already replicates over every rank"
        )
    if not sizes.inferred_dp and sizes.dp_size != world_size:
        raise ValueError(
            f"ParallelismSizes.dp_size={sizes.dp_size} must equal world_size={world_size} for DDP"
        )
    return MeshLayout(kind=MeshKind.DDP, world_size=world_size, dp_replicate=world_size, ep_shard=world_size)


def _check_megatron(sizes: ParallelismSizes, dp_replicate: int) -> None:
    """Megatron-FSDP has no pipeline, expert or HSDP axis."""
    for name in ("pp_size", "ep_size"):
        if getattr(sizes, name) > 1:
            raise ValueError(
                f"ParallelismSizes.{name}={getattr(sizes, name)} is not supported by Megatron-FSDP; "
                "use FSDP2Config for pipeline or expert parallelism"
            )
    if dp_replicate > 1:
        raise ValueError(
            f"ParallelismSizes.dp_replicate_size={dp_replicate} (HSDP) is only supported by FSDP2Config"
        )


def resolve_layout(kind: MeshKind, sizes: ParallelismSizes, world_size: int) -> MeshLayout:
    """Validate ``sizes`` against ``world_size`` for a mesh kind and return the final layout.

    Pure: creates no process group, so it is safe to call before ``init_process_group`` and gives
    the same answer on every rank.

    Args:
        kind: The layout the strategy needs.
        sizes: The user's parallel degrees.
        world_size: Number of ranks the mesh spans.

    Returns:
        The layout with ``dp`` inferred when it was left to ``None``.

    Raises:
        ValueError: The sizes cannot tile ``world_size`` for this strategy; the message names the sizes
            and the product that does not divide.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    dp_replicate = sizes.dp_replicate_size or 1
    if dp_replicate == -1:
        raise ValueError(
            "ParallelismSizes.dp_replicate_size cannot be inferred (-1); give it or leave it None"
        )

    if kind is MeshKind.DDP:
        return _ddp_layout(sizes, dp_replicate, world_size)
    if kind is MeshKind.MEGATRON_FSDP:
        _check_megatron(sizes, dp_replicate)

    pp, cp, tp, ep = sizes.pp_size, sizes.cp_size, sizes.tp_size, sizes.ep_size
    if sizes.inferred_dp:
        if world_size % (pp * cp * tp) != 0:
            raise ValueError(
                f"world_size={world_size} is not divisible by "
                f"{_product('pp_size * cp_size * tp_size', (pp, cp, tp))}; "
                "choose sizes whose product divides the number of ranks"
            )
        dp = world_size // (pp * cp * tp)
    else:
        assert sizes.dp_size is not None
        dp = sizes.dp_size
        total = pp * dp * cp * tp
        if total != world_size:
            raise ValueError(
                f"{_product('pp_size * dp_size * cp_size * tp_size', (pp, dp, cp, tp))} does not equal "
                f"world_size={world_size}; leave dp_size=None to infer it"
            )

    if dp % dp_replicate != 0:
        raise ValueError(
            f"dp_size={dp} is not divisible by ParallelismSizes.dp_replicate_size={dp_replicate}; "
            "HSDP needs dp_size = dp_replicate_size * dp_shard_size"
        )
    if dp_replicate > 1 and dp_replicate == dp:
        raise ValueError(
            f"ParallelismSizes.dp_replicate_size={dp_replicate} equals dp_size={dp}, which leaves nothing to "
            "shard (pure replication); use DDPConfig, or a smaller dp_replicate_size for HSDP"
        )

    non_pp = dp * cp * tp
    if non_pp % ep != 0:
        raise ValueError(
            f"ParallelismSizes.ep_size={ep} does not divide "
            f"{_product('dp_size * cp_size * tp_size', (dp, cp, tp))}; "
            "expert parallelism regroups the non-pipeline ranks, so ep_size must divide their number"
        )
    return MeshLayout(
        kind=kind,
        world_size=world_size,
        pp=pp,
        dp_replicate=dp_replicate,
        dp_shard=dp // dp_replicate,
        cp=cp,
        tp=tp,
        ep=ep,
        ep_shard=non_pp // ep,
    )
