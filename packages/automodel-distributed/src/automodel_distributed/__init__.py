"""automodel-distributed: FSDP2 / Megatron-FSDP / DDP managers, TP/SP plans, activation checkpointing.

Configs are imported eagerly (they are light). The managers pull in ``torch.distributed.fsdp`` and
DTensor, which take seconds to import, so they are loaded on first access: ``import
automodel_distributed`` stays as cheap as ``import torch``.
"""

from importlib.metadata import PackageNotFoundError, version

import lazy_loader

from automodel_distributed.config import CompileConfig as CompileConfig
from automodel_distributed.config import DDPConfig as DDPConfig
from automodel_distributed.config import DistributedConfig as DistributedConfig
from automodel_distributed.config import FSDP2Config as FSDP2Config
from automodel_distributed.config import MegatronFSDPConfig as MegatronFSDPConfig

# The names of __init__.pyi (what type checkers read) are loaded on first attribute access (SPEC 1).
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__"]

try:
    __version__ = version("automodel-distributed")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"
