"""`installed_version`: the ``__version__`` of every automodel package, from its distribution's metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["installed_version"]


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution``; ``"0.0.0"`` in a source tree without metadata."""
    try:
        return version(distribution)
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
        return "0.0.0"
