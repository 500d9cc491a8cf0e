"""`MeshContext`: the single source of truth for meshes, parallel sizes and axis names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from automodel_mesh._device_mesh import flattened_meshes, slice_mesh
from automodel_mesh.axes import FLATTENED_AXES, MeshAxisName
from automodel_mesh.build import build_meshes, device_type_for_backend, validate_ranks
from automodel_mesh.layout import MeshKind, MeshLayout, MeshStrategy, mesh_kind_of, resolve_layout
from automodel_mesh.sizes import ParallelismSizes

__all__ = ["MeshContext"]

_ALLOWED_AXES = frozenset(a.value for a in MeshAxisName)


def _check_axis_names(mesh: DeviceMesh | None, what: str) -> None:
    if mesh is None:
        return
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(
            f"{what} has no mesh_dim_names; name its axes with automodel_mesh.MeshAxisName values"
        )
    unknown = [n for n in names if n not in _ALLOWED_AXES]
    if unknown:
        raise ValueError(f"{what} has axis name(s) {unknown}; allowed names are {sorted(_ALLOWED_AXES)}")


@dataclass
class MeshContext:
    """Device meshes and the parallel sizes derived from them.

    Sizes are read live from the meshes, never stored, so they cannot drift from what the process
    groups really are. An empty context (no meshes) stands for a single device: every size is 1.

    Build one with `MeshContext.build` (validates sizes, then creates the process groups) or wrap
    meshes you already have with `MeshContext.from_meshes`.
    """

    device_mesh: DeviceMesh | None = None
    """Dense mesh: ``(pp, dp_replicate, dp_shard, cp, tp)`` for FSDP2, ``(dp, cp, tp)`` for Megatron-FSDP,
    ``None`` for DDP and single-device runs."""
    moe_mesh: DeviceMesh | None = None
    """``(pp, ep_shard, ep)`` over the same ranks when expert parallelism is on, else ``None``."""
    process_group: dist.ProcessGroup | None = field(default=None, repr=False)
    """The process group spanning the mesh's ranks (the default group unless ``ranks=`` was given;
    ``None`` on ranks outside ``ranks=``)."""
    _member: bool = field(default=True, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_axis_names(self.device_mesh, "device_mesh")
        _check_axis_names(self.moe_mesh, "moe_mesh")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def build(
        cls,
        strategy_config: MeshStrategy | MeshKind | str,
        parallelism_sizes: ParallelismSizes | None = None,
        *,
        world_size: int | None = None,
        timeout_minutes: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> MeshContext:
        """Validate the requested sizes, then build the meshes the strategy needs.

        Preconditions: the default process group is initialised (``torch.distributed.init_process_group``),
        unless the run is a single process, in which case an empty single-device context is returned.
        Collective: every rank of the default group calls it with the same arguments. All validation runs
        before the first collective, so a bad layout raises the same `ValueError` on every rank.

        Args:
            strategy_config: A strategy config implementing `MeshStrategy` (``FSDP2Config``,
                ``MegatronFSDPConfig``, ``DDPConfig``), or a `MeshKind`.
            parallelism_sizes: Requested degrees; ``None`` means plain data parallelism over every rank.
            world_size: Expected number of ranks; checked against the process group (or ``len(ranks)``).
            timeout_minutes: Timeout for the process groups created for the mesh.
            ranks: Build the mesh over these global ranks only (in mesh order). Ranks outside still call
                `build` and get a context whose `is_member` is ``False``.

        Returns:
            The context. Device type is ``cuda`` under an NCCL backend with CUDA available, else ``cpu``.

        Raises:
            ValueError: An impossible layout, a world size that does not match, bad ``ranks`` or timeout.
        """
        kind = mesh_kind_of(strategy_config)
        sizes = parallelism_sizes if parallelism_sizes is not None else ParallelismSizes()
        if not isinstance(sizes, ParallelismSizes):
            raise ValueError(
                f"parallelism_sizes must be a ParallelismSizes, got {type(sizes).__name__}; "
                "use ParallelismSizes.from_dict for a dict"
            )
        if timeout_minutes is not None and (isinstance(timeout_minutes, bool) or not timeout_minutes > 0):
            raise ValueError(f"timeout_minutes must be a positive number, got {timeout_minutes!r}")
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
            raise ValueError(f"world_size must be an int, got {world_size!r}")

        if not (dist.is_available() and dist.is_initialized()):
            expected = len(ranks) if ranks is not None else (world_size if world_size is not None else 1)
            # Validate even though nothing is built, so a bad layout fails in single-process dry runs too.
            resolve_layout(kind, sizes, expected)
            if expected != 1:
                raise ValueError(
                    f"a mesh over {expected} ranks needs an initialised default process group: call "
                    "torch.distributed.init_process_group() (or launch with torchrun) before "
                    "MeshContext.build"
                )
            return cls()

        default_world = dist.get_world_size()
        if ranks is not None:
            rank_list: list[int] | None = validate_ranks(ranks, default_world)
            mesh_world = len(ranks)
            source = f"len(ranks)={mesh_world}"
        else:
            rank_list = None
            mesh_world = default_world
            source = f"the default process group's size {default_world}"
        if world_size is not None and world_size != mesh_world:
            raise ValueError(f"world_size={world_size} does not match {source}")
        layout = resolve_layout(kind, sizes, mesh_world)
        built = build_meshes(
            layout,
            device_type=device_type_for_backend(str(dist.get_backend())),
            ranks=rank_list,
            timeout=timedelta(minutes=timeout_minutes) if timeout_minutes is not None else None,
        )
        ctx = cls(device_mesh=built.device_mesh, moe_mesh=built.moe_mesh, process_group=built.process_group)
        ctx._member = built.process_group is not None
        return ctx

    @classmethod
    def from_meshes(cls, device_mesh: DeviceMesh | None, moe_mesh: DeviceMesh | None = None) -> MeshContext:
        """Wrap meshes built elsewhere; their axis names must be `MeshAxisName` values.

        Raises:
            ValueError: A mesh axis has a name outside `MeshAxisName`.
        """
        return cls(device_mesh=device_mesh, moe_mesh=moe_mesh)

    @staticmethod
    def resolve(
        strategy_config: MeshStrategy | MeshKind | str,
        parallelism_sizes: ParallelismSizes | None,
        world_size: int,
    ) -> MeshLayout:
        """Validate a layout for ``world_size`` ranks without creating any process group (dry runs)."""
        sizes = parallelism_sizes if parallelism_sizes is not None else ParallelismSizes()
        return resolve_layout(mesh_kind_of(strategy_config), sizes, world_size)

    # ------------------------------------------------------------------ sizes

    def _meshes(self) -> tuple[DeviceMesh, ...]:
        return tuple(m for m in (self.device_mesh, self.moe_mesh) if m is not None)

    def _axis_size(self, axis: str) -> int | None:
        for mesh in self._meshes():
            names = tuple(mesh.mesh_dim_names or ())
            if axis in names:
                return int(mesh.size(names.index(axis)))
            flat = flattened_meshes(mesh).get(axis)
            if flat is not None:
                return int(flat.size())
        # A mesh from `from_meshes` may lack a flattened axis: derive it from the axes it spans.
        parts = FLATTENED_AXES.get(MeshAxisName(axis)) if axis in _ALLOWED_AXES else None
        if parts and self.device_mesh is not None:
            sizes = [self._axis_size(p.value) for p in parts]
            present = [s for s in sizes if s is not None]
            if present:
                out = 1
                for s in present:
                    out *= s
                return out
        return None

    @property
    def world_size(self) -> int:
        """Number of ranks the context spans (1 for an empty context)."""
        if self.device_mesh is not None:
            return int(self.device_mesh.size())
        if self.process_group is not None:
            return int(dist.get_world_size(self.process_group))
        return 1

    @property
    def pp_size(self) -> int:
        """Pipeline-parallel degree (1 when there is no ``pp`` axis)."""
        return self._axis_size(MeshAxisName.PP.value) or 1

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree (1 when there is no ``tp`` axis)."""
        return self._axis_size(MeshAxisName.TP.value) or 1

    @property
    def cp_size(self) -> int:
        """Context-parallel degree (1 when there is no ``cp`` axis)."""
        return self._axis_size(MeshAxisName.CP.value) or 1

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree from the MoE mesh (1 without one)."""
        if self.moe_mesh is None:
            return 1
        return self._axis_size(MeshAxisName.EP.value) or 1

    @property
    def ep_shard_size(self) -> int:
        """Expert FSDP degree from the MoE mesh (1 without one)."""
        if self.moe_mesh is None:
            return 1
        return self._axis_size(MeshAxisName.EP_SHARD.value) or 1

    @property
    def dp_size(self) -> int | None:
        """Data-parallel degree; the process group's size for DDP; ``None`` for an empty context."""
        size = self._axis_size(MeshAxisName.DP.value)
        if size is None and self.device_mesh is None and self.process_group is not None:
            return self.world_size
        return size

    @property
    def dp_replicate_size(self) -> int | None:
        """HSDP replica count; ``None`` when the mesh has no ``dp_replicate`` axis."""
        return self._axis_size(MeshAxisName.DP_REPLICATE.value)

    @property
    def dp_shard_size(self) -> int:
        """FSDP shard degree inside one replica (1 when there is no ``dp_shard`` axis)."""
        return self._axis_size(MeshAxisName.DP_SHARD.value) or 1

    @property
    def dp_shard_cp_size(self) -> int:
        """Size of the FSDP sharding axis ``dp_shard x cp`` (1 when absent)."""
        return self._axis_size(MeshAxisName.DP_SHARD_CP.value) or 1

    @property
    def dp_cp_size(self) -> int:
        """Size of ``dp x cp`` (1 when absent)."""
        return self._axis_size(MeshAxisName.DP_CP.value) or 1

    @property
    def pp_enabled(self) -> bool:
        """Whether pipeline parallelism is on (``pp_size > 1``)."""
        return self.pp_size > 1

    @property
    def kind(self) -> MeshKind | None:
        """The layout of the dense mesh, or DDP for a process group alone, or ``None`` when empty."""
        if self.device_mesh is not None:
            names = tuple(self.device_mesh.mesh_dim_names or ())
            return MeshKind.FSDP2 if MeshAxisName.DP_SHARD.value in names else MeshKind.MEGATRON_FSDP
        return MeshKind.DDP if self.process_group is not None else None

    @property
    def layout(self) -> MeshLayout:
        """The sizes of this context as a `MeshLayout`: what `resolve` gives a dry run of the same job.

        Read live from the meshes, like every size here, and not validated again (a context wrapping
        meshes built elsewhere may have axes no strategy builds). An empty context is a one-rank layout.
        """
        kind, world = self.kind or MeshKind.FSDP2, self.world_size
        if kind is MeshKind.DDP:  # every rank a replica, as `resolve_layout` lays DDP out
            return MeshLayout(kind=kind, world_size=world, dp_replicate=world, ep_shard=world)
        replicate, dp = self.dp_replicate_size or 1, self.dp_size or 1
        # Without experts `resolve_layout` still names the ranks an expert would shard over.
        ep_shard = self.ep_shard_size if self.ep_size > 1 else dp * self.cp_size * self.tp_size
        return MeshLayout(
            kind=kind,
            world_size=world,
            pp=self.pp_size,
            dp_replicate=replicate,
            dp_shard=max(dp // replicate, 1),
            cp=self.cp_size,
            tp=self.tp_size,
            ep=self.ep_size,
            ep_shard=ep_shard,
        )

    @property
    def device_type(self) -> str:
        """``"cuda"`` or ``"cpu"``: the device type of the meshes, else of the process group's backend.

        A DDP context has no mesh: its NCCL process group means ``"cuda"``. An empty context is ``"cpu"``.
        """
        if self.device_mesh is not None:
            return self.device_mesh.device_type
        if self.process_group is not None:
            return device_type_for_backend(str(dist.get_backend(self.process_group)))
        return "cpu"

    @property
    def is_member(self) -> bool:
        """Whether this rank belongs to the meshes (``False`` only for ranks outside ``ranks=``)."""
        if self.device_mesh is not None:
            return self.device_mesh.get_coordinate() is not None
        return self._member

    # ------------------------------------------------------------------ axes

    def axis_names(self) -> tuple[str, ...]:
        """Every axis name this context can hand out: real axes of both meshes, then flattened ones."""
        out: list[str] = []
        for mesh in self._meshes():
            out.extend(n for n in (mesh.mesh_dim_names or ()) if n not in out)
        for mesh in self._meshes():
            out.extend(n for n in flattened_meshes(mesh) if n not in out)
        return tuple(out)

    def has_axis(self, axis: MeshAxisName | str) -> bool:
        """Whether ``axis`` is a real or flattened axis of one of the meshes."""
        return str(axis) in self.axis_names()

    def submesh(self, *axes: MeshAxisName | str) -> DeviceMesh:
        """Return the sub-mesh over ``axes`` (real or flattened) of the dense mesh, or of the MoE mesh.

        Raises:
            ValueError: An axis does not exist; the message lists the ones that do.
        """
        names = tuple(str(a) for a in axes)
        if not names:
            raise ValueError("submesh needs at least one axis name")
        for mesh in self._meshes():
            available = set(mesh.mesh_dim_names or ()) | set(flattened_meshes(mesh))
            if all(n in available for n in names):
                return slice_mesh(mesh, names)
        raise ValueError(f"no mesh has axes {list(names)}; available axes: {list(self.axis_names())}")

    def get_group(self, axis: MeshAxisName | str) -> dist.ProcessGroup:
        """Return this rank's process group along ``axis``."""
        return self.submesh(axis).get_group()

    def dp_axis_names(self) -> tuple[str, ...]:
        """Return the axes FSDP shards over.

        ``(dp_replicate, dp_shard_cp)`` for FSDP2, ``(dp_cp,)`` for Megatron-FSDP (the axis its mesh has;
        the reference system names ``dp_shard_cp`` there too, which that mesh lacks), and
        ``(dp_shard_cp,)`` without a mesh (an empty or DDP context), as in the reference system.
        """
        kind = self.kind
        if kind is MeshKind.FSDP2:
            return (MeshAxisName.DP_REPLICATE.value, MeshAxisName.DP_SHARD_CP.value)
        if kind is MeshKind.MEGATRON_FSDP:
            return (MeshAxisName.DP_CP.value,)
        return (MeshAxisName.DP_SHARD_CP.value,)

    _dp_axis_names = dp_axis_names  # name used by code written for NeMo AutoModel

    def parallelize_axis_kwargs(self) -> dict[str, Any]:
        """Return the axis-name keyword arguments a ``parallelize_fn`` takes.

        Keys: ``dp_axis_names``, ``cp_axis_name``, ``tp_axis_name``, ``ep_axis_name``,
        ``ep_shard_axis_names`` (``None`` where the axis is absent).
        """
        dense = tuple(self.device_mesh.mesh_dim_names or ()) if self.device_mesh is not None else ()
        moe = self.moe_mesh is not None
        return {
            "dp_axis_names": self.dp_axis_names(),
            "cp_axis_name": MeshAxisName.CP.value if MeshAxisName.CP.value in dense else None,
            "tp_axis_name": MeshAxisName.TP.value if MeshAxisName.TP.value in dense else None,
            "ep_axis_name": MeshAxisName.EP.value if moe else None,
            "ep_shard_axis_names": (MeshAxisName.EP_SHARD.value,) if moe else None,
        }

    def pipeline_axis_kwargs(self) -> dict[str, Any]:
        """`parallelize_axis_kwargs` plus ``pp_axis_name`` for ``AutoPipeline``."""
        return {"pp_axis_name": MeshAxisName.PP.value, **self.parallelize_axis_kwargs()}

    def describe(self) -> str:
        """A short human-readable summary of the meshes and sizes."""
        if self.device_mesh is None and self.process_group is None:
            return "single device (no mesh)"
        kind = self.kind.value if self.kind else "no"
        lines = [f"{kind} layout over {self.world_size} rank(s) on {self.device_type}"]
        for label, mesh in (("dense", self.device_mesh), ("moe", self.moe_mesh)):
            if mesh is None:
                continue
            names = tuple(mesh.mesh_dim_names or ())
            shape = ", ".join(f"{n}={mesh.size(i)}" for i, n in enumerate(names))
            lines.append(f"  {label} mesh ({shape})")
            flat = flattened_meshes(mesh)
            if flat:
                lines.append("  flattened  (" + ", ".join(f"{n}={m.size()}" for n, m in flat.items()) + ")")
        if self.device_mesh is None:
            lines.append(f"  no device mesh: data parallel over {self.world_size} rank(s)")
        return "\n".join(lines)
