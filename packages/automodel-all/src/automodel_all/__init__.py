"""automodel-all.

The public API of this package arrives with the issue that builds it; until then it exports only its
version, so nothing here pretends to work.
"""

from automodel_mesh.version import installed_version

__version__ = installed_version("automodel-all")

__all__ = ["__version__"]
