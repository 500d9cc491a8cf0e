"""`load_script`: import a repository script (``tools/``, ``benchmarks/``) that is not a package, by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: Path) -> ModuleType:
    """Import the script at ``path`` as the module named for its stem.

    Mutates ``sys.path`` (the script's folder goes first, so the script's imports of its neighbours
    resolve) and ``sys.modules`` (the module is registered under its stem before it runs, because
    dataclasses look their defining module up while the class body runs).
    """
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, f"{path} is not a Python file"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
