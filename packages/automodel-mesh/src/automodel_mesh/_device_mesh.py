"""The few `DeviceMesh` operations torch only offers privately, isolated in one place.

torch 2.15 still has no public flatten; flattened meshes live in the root mesh's ``_flatten_mapping``
and slicing them from the root warns about a coming deprecation. Every private access goes through
this module so a torch upgrade touches one file.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten", "flattened_meshes", "slice_mesh"]

_FLATTEN_SLICE_WARNING = r"Slicing a flattened dim from root mesh"


@contextmanager
def _quiet_flattened_slicing() -> Iterator[None]:
    # We bookkeep flattened meshes ourselves where we can; multi-axis slices that mix a flattened axis
    # with a real one (HSDP's (dp_replicate, dp_shard_cp)) have no other spelling in torch yet.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FLATTEN_SLICE_WARNING, category=UserWarning)
        yield


def flatten(
    mesh: DeviceMesh, axes: Sequence[str], name: str, backend_override: Any = None
) -> DeviceMesh | None:
    """Flatten ``axes`` of the root ``mesh`` into a 1-D mesh called ``name``.

    Collective over the default group: ``new_group`` needs every rank, including ranks outside a mesh
    built on a subset of them. torch cannot slice a mesh on such a rank, so there we create the same
    groups, in the same order, from the mesh layout and return ``None``.

    ``backend_override`` is torch's ``(backend, options)`` pair for the new groups, or ``None``.
    """
    if mesh.get_coordinate() is not None:
        return mesh[tuple(axes)]._flatten(name, backend_override=backend_override)
    flat_layout = _MeshLayout([mesh._get_slice_mesh_layout(tuple(axes)).collapse()])
    DeviceMesh._init_process_groups(
        flat_layout,
        mesh._rank_map,
        (name,),
        (backend_override or (None, None),),
        mesh._preserve_rank_order,
    )
    return None


def flattened_meshes(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    """Return the flattened meshes registered on ``mesh``'s root, keyed by axis name."""
    root = mesh._get_root_mesh()
    mapping: dict[str, DeviceMesh] = getattr(root, "_flatten_mapping", {}) or {}
    return dict(mapping)


def slice_mesh(mesh: DeviceMesh, axes: Sequence[str]) -> DeviceMesh:
    """Return ``mesh[axes]``, allowing flattened axes of the root mesh among ``axes``."""
    names = tuple(axes)
    if len(names) == 1:
        flat = flattened_meshes(mesh).get(names[0])
        if flat is not None and names[0] not in (mesh.mesh_dim_names or ()):
            return flat
    with _quiet_flattened_slicing():
        return mesh[names[0] if len(names) == 1 else names]
