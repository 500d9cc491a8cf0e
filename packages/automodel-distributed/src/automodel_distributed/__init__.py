"""automodel-distributed: FSDP2 / Megatron-FSDP / DDP managers, TP/SP plans, activation checkpointing.

Configs are imported eagerly (they are light). The managers pull in ``torch.distributed.fsdp`` and
DTensor, which take seconds to import, so they are loaded on first access: ``import
automodel_distributed`` stays as cheap as ``import torch``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from automodel_distributed.config import (
    CompileConfig,
    DDPConfig,
    DistributedConfig,
    FSDP2Config,
    MegatronFSDPConfig,
)

if TYPE_CHECKING:
    from automodel_distributed.ddp import DDPManager
    from automodel_distributed.fsdp2 import FSDP2Manager
    from automodel_distributed.megatron_fsdp import MegatronFSDPManager

try:
    __version__ = version("automodel-distributed")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"

# Public name -> module that defines it, imported on first attribute access.
_LAZY = {
    "FSDP2Manager": "automodel_distributed.fsdp2",
    "DDPManager": "automodel_distributed.ddp",
    "MegatronFSDPManager": "automodel_distributed.megatron_fsdp",
}

__all__ = [
    "CompileConfig",
    "DDPConfig",
    "DDPManager",
    "DistributedConfig",
    "FSDP2Config",
    "FSDP2Manager",
    "MegatronFSDPConfig",
    "MegatronFSDPManager",
    "__version__",
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
