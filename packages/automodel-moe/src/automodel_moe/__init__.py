"""automodel-moe.

The public API of this package arrives with the issue that builds it; until then it exports only its
version, so nothing here pretends to work.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("automodel-moe")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"

__all__ = ["__version__"]
