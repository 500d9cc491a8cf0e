"""Turn a validated `MeshLayout` into real device meshes and process groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from automodel_mesh._device_mesh import flatten
from automodel_mesh.layout import MeshLayout

__all__ = ["BuiltMeshes", "build_meshes", "device_type_for_backend", "validate_ranks"]


@dataclass(frozen=True)
class BuiltMeshes:
    """The runtime objects built for a layout."""

    device_mesh: DeviceMesh | None
    moe_mesh: DeviceMesh | None
    process_group: dist.ProcessGroup | None


def device_type_for_backend(backend: str) -> str:
    """Return ``"cuda"`` when ``backend`` drives NCCL and CUDA is available, else ``"cpu"``.

    ``torch.cuda.is_available()`` does not initialise CUDA, so this is safe in a CPU-only process.
    """
    if "nccl" in backend.lower() and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def validate_ranks(ranks: Sequence[int], world_size: int) -> list[int]:
    """Check that ``ranks`` is a non-empty list of distinct ranks of the default group.

    Raises:
        ValueError: Naming the offending ranks.
    """
    out = list(ranks)
    if not out:
        raise ValueError("ranks must name at least one rank")
    if any(isinstance(r, bool) or not isinstance(r, int) for r in out):
        raise ValueError(f"ranks must be ints, got {out!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"ranks must be distinct, got {out!r}")
    outside = [r for r in out if not 0 <= r < world_size]
    if outside:
        raise ValueError(f"ranks {outside} are outside the default process group of {world_size} rank(s)")
    return out


def _timeout_options(timeout: timedelta, backend: str) -> Any:
    """Backend options that carry ``timeout`` to every process group torch creates for a mesh axis."""
    options: Any
    if "nccl" in backend.lower():
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # absent from torch's stubs
    options._timeout = timeout
    return options


def build_meshes(
    layout: MeshLayout,
    *,
    device_type: str,
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
) -> BuiltMeshes:
    """Create the device meshes of ``layout``.

    Collective: every rank of the default process group must call it with the same arguments (torch
    creates each sub-group with ``new_group``), including ranks outside ``ranks``.

    Args:
        layout: A layout from `resolve_layout`; its ``world_size`` is ``len(ranks)`` or the world size.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
        ranks: Global ranks the meshes span, in mesh order; ``None`` means every rank.
        timeout: Timeout for the process groups created here (not the default group).

    Returns:
        The dense mesh with its flattened axes (``None`` for DDP), the MoE mesh (``None`` unless
        ``ep > 1``) and the process group spanning ``ranks``.
    """
    rank_list = list(range(layout.world_size)) if ranks is None else list(ranks)
    assert len(rank_list) == layout.world_size, "layout was resolved for a different number of ranks"

    # With a timeout, every axis gets its own group carrying it (torch would otherwise reuse the default
    # group for an axis spanning every rank, and the default group's timeout belongs to the caller).
    override: tuple[str | None, Any] | None = None
    if timeout is not None:
        override = (None, _timeout_options(timeout, str(dist.get_backend())))
    group = dist.group.WORLD if ranks is None else dist.new_group(rank_list, timeout=timeout)
    # new_group hands non-members a sentinel, not a group: they keep None.
    process_group = group if isinstance(group, dist.ProcessGroup) else None

    if not layout.has_device_mesh:
        return BuiltMeshes(device_mesh=None, moe_mesh=None, process_group=process_group)

    shape = layout.dense_shape()
    names = tuple(axis.value for axis, _ in shape)
    # DeviceMesh takes its rank tensor on the host, whatever the mesh's device type.
    rank_tensor = torch.tensor(rank_list, dtype=torch.int, device="cpu").reshape(tuple(n for _, n in shape))
    device_mesh = DeviceMesh(
        device_type,
        rank_tensor,
        mesh_dim_names=names,
        backend_override=(override,) * len(names) if override is not None else None,
    )
    for flat_name, axes in layout.flattened_axes().items():
        flatten(device_mesh, [a.value for a in axes], flat_name.value, backend_override=override)

    moe_mesh: DeviceMesh | None = None
    if layout.has_moe_mesh:
        # Same ranks in the same row-major order, regrouped: ep varies fastest over the non-pp ranks,
        # exactly as flattening them and splitting into (ep_shard, ep) would.
        moe_shape = layout.moe_shape()
        moe_mesh = DeviceMesh(
            device_type,
            rank_tensor.reshape(tuple(size for _, size in moe_shape)),
            mesh_dim_names=tuple(axis.value for axis, _ in moe_shape),
            backend_override=(override,) * len(moe_shape) if override is not None else None,
        )
    return BuiltMeshes(device_mesh=device_mesh, moe_mesh=moe_mesh, process_group=process_group)
