"""automodel-mesh: device meshes, parallel sizes and axis names (depends on torch only)."""

from automodel_mesh.axes import DENSE_AXES, FLATTENED_AXES, MOE_AXES, MeshAxisName
from automodel_mesh.collectives import Collective, NodeFanout, Overlap, traffic_of
from automodel_mesh.context import MeshContext
from automodel_mesh.layout import MeshKind, MeshLayout, MeshStrategy, mesh_kind_of, resolve_layout
from automodel_mesh.sizes import ParallelismSizes
from automodel_mesh.version import installed_version

__version__ = installed_version("automodel-mesh")

__all__ = [
    "DENSE_AXES",
    "FLATTENED_AXES",
    "MOE_AXES",
    "Collective",
    "MeshAxisName",
    "MeshContext",
    "MeshKind",
    "MeshLayout",
    "MeshStrategy",
    "NodeFanout",
    "Overlap",
    "ParallelismSizes",
    "__version__",
    "mesh_kind_of",
    "resolve_layout",
    "traffic_of",
]
