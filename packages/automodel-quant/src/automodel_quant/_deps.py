"""Lazy imports of the heavy or optional packages, with errors that say what to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_bitsandbytes", "import_torchao"]


def import_torchao(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a ``torchao`` submodule) for ``feature``.

    Raises:
        ImportError: torchao (a dependency of automodel-quant) is missing or too old.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs torchao ({module} could not be imported: {exc}); torchao is a dependency of "
            "automodel-quant: reinstall it with `pip install automodel-quant`"
        ) from exc


def import_bitsandbytes(feature: str) -> ModuleType:
    """Import ``bitsandbytes`` for ``feature``.

    Raises:
        ImportError: bitsandbytes (the optional ``[bnb]`` extra) is not installed.
    """
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs bitsandbytes, which is not installed ({exc}); install the extra with "
            "`pip install automodel-quant[bnb]`"
        ) from exc
