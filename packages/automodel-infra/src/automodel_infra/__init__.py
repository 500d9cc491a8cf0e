"""automodel-infra: the two orchestration functions of automodel.

`instantiate_infrastructure` turns configs and a `MeshContext` into runtime objects;
`apply_model_infrastructure` applies them to a (usually meta) model in a fixed order and loads its
checkpoint into the shards. See `automodel_infra.infrastructure` and docs/concepts.md.

The functions live in `automodel_infra.infrastructure`, which imports ``torch.distributed`` and the
strategy managers; they are loaded on first access so that ``import automodel_infra`` stays cheap.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from automodel_infra.infrastructure import (
        Infrastructure,
        apply_model_infrastructure,
        instantiate_infrastructure,
        parallelize_for_pp,
    )
    from automodel_infra.setup import DistributedSetup

try:
    __version__ = version("automodel-infra")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"

_LAZY = {
    "DistributedSetup": "automodel_infra.setup",
    "Infrastructure": "automodel_infra.infrastructure",
    "apply_model_infrastructure": "automodel_infra.infrastructure",
    "instantiate_infrastructure": "automodel_infra.infrastructure",
    "parallelize_for_pp": "automodel_infra.infrastructure",
}

__all__ = [
    "DistributedSetup",
    "Infrastructure",
    "__version__",
    "apply_model_infrastructure",
    "instantiate_infrastructure",
    "parallelize_for_pp",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
