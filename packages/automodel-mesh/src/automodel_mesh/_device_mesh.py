"""The few `DeviceMesh` operations torch only offers privately, isolated in one place.

torch 2.15 still has no public flatten; flattened meshes live in the root mesh's ``_flatten_mapping``
and slicing them from the root warns about a coming deprecation. Every private access goes through
this module so a torch upgrade touches one file.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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


def flatten(mesh: DeviceMesh, axes: Sequence[str], name: str) -> DeviceMesh:
    """Flatten ``axes`` of the root ``mesh`` into a 1-D mesh called ``name`` (collective on all ranks)."""
    return mesh[tuple(axes)]._flatten(name)


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
