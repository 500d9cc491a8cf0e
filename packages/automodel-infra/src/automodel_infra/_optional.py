"""Import an optional automodel component, or say which distribution to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["OPTIONAL_COMPONENTS", "import_component"]

OPTIONAL_COMPONENTS: dict[str, tuple[str, str]] = {
    # import name -> (distribution, the automodel-infra extra that pulls it in)
    "automodel_pipelining": ("automodel-pipelining", "pp"),
    "automodel_moe": ("automodel-moe", "moe"),
    "automodel_quant": ("automodel-quant", "quant"),
    "automodel_peft": ("automodel-peft", "peft"),
}


def import_component(module: str, needed_for: str) -> ModuleType:
    """Import ``module`` (an optional automodel package or one of its submodules).

    Args:
        module: Dotted module name, e.g. ``"automodel_peft"`` or ``"automodel_quant.fp8"``.
        needed_for: What the caller asked for, named in the error (e.g. ``"peft_config"``).

    Raises:
        ImportError: The package is not installed; the message names the distribution and the command
            that installs it.
    """
    top = module.split(".", 1)[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".", 1)[0] != top or top not in OPTIONAL_COMPONENTS:
            raise
        distribution, extra = OPTIONAL_COMPONENTS[top]
        raise ImportError(
            f"{needed_for} needs {distribution}, which is not installed: "
            f"`pip install {distribution}` (or `pip install automodel-infra[{extra}]`)"
        ) from exc
