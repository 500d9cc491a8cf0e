"""automodel-distributed: FSDP2 / Megatron-FSDP / DDP managers, TP/SP plans, activation checkpointing.

Configs are imported eagerly (they are light). The managers pull in ``torch.distributed.fsdp`` and
DTensor, which take seconds to import, so they are loaded on first access: ``import
automodel_distributed`` stays as cheap as ``import torch``.
"""

import lazy_loader

from automodel_distributed.config import CompileConfig as CompileConfig
from automodel_distributed.config import DDPConfig as DDPConfig
from automodel_distributed.config import DistributedConfig as DistributedConfig
from automodel_distributed.config import FSDP2Config as FSDP2Config
from automodel_distributed.config import MegatronFSDPConfig as MegatronFSDPConfig
from automodel_mesh.version import installed_version

# The names of __init__.pyi (what type checkers read) load on first access (SPEC 1).
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__"]

__version__ = installed_version("automodel-distributed")
