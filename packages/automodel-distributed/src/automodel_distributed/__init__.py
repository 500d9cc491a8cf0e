"""automodel-distributed: FSDP2 / Megatron-FSDP / DDP managers, TP/SP/CP plans, activation checkpointing.

Configs are imported eagerly (they are light). The managers pull in ``torch.distributed.fsdp`` and
DTensor, which take seconds to import, so they are loaded on first access: ``import
automodel_distributed`` stays as cheap as ``import torch``. The checkpoint functions the documented
API lists here are automodel-checkpoint's (light, imported eagerly).
"""

import lazy_loader

from automodel_checkpoint import (
    COMPLETE_MARKER as COMPLETE_MARKER,
)
from automodel_checkpoint import (
    DEFAULT_KEY_RULES as DEFAULT_KEY_RULES,
)
from automodel_checkpoint import (
    AsyncCheckpointer as AsyncCheckpointer,
)
from automodel_checkpoint import (
    CheckpointFiles as CheckpointFiles,
)
from automodel_checkpoint import (
    CheckpointInfo as CheckpointInfo,
)
from automodel_checkpoint import (
    CheckpointMismatchError as CheckpointMismatchError,
)
from automodel_checkpoint import (
    CorruptCheckpointError as CorruptCheckpointError,
)
from automodel_checkpoint import (
    KeyRules as KeyRules,
)
from automodel_checkpoint import (
    LoadReport as LoadReport,
)
from automodel_checkpoint import (
    check_hf_checkpoint as check_hf_checkpoint,
)
from automodel_checkpoint import (
    checkpoint_key as checkpoint_key,
)
from automodel_checkpoint import (
    initialize_model_weights as initialize_model_weights,
)
from automodel_checkpoint import (
    is_complete_checkpoint as is_complete_checkpoint,
)
from automodel_checkpoint import (
    latest_checkpoint as latest_checkpoint,
)
from automodel_checkpoint import (
    load_base_model as load_base_model,
)
from automodel_checkpoint import (
    load_distributed_checkpoint as load_distributed_checkpoint,
)
from automodel_checkpoint import (
    load_hf_checkpoint as load_hf_checkpoint,
)
from automodel_checkpoint import (
    materialize_meta_tensors as materialize_meta_tensors,
)
from automodel_checkpoint import (
    read_marker as read_marker,
)
from automodel_checkpoint import (
    register_buffer_initializer as register_buffer_initializer,
)
from automodel_checkpoint import (
    reinitialize_non_persistent_buffers as reinitialize_non_persistent_buffers,
)
from automodel_checkpoint import (
    resolve_checkpoint as resolve_checkpoint,
)
from automodel_checkpoint import (
    retie_weights as retie_weights,
)
from automodel_checkpoint import (
    save_distributed_checkpoint as save_distributed_checkpoint,
)
from automodel_checkpoint import (
    save_hf_checkpoint as save_hf_checkpoint,
)
from automodel_checkpoint import (
    verify_materialized as verify_materialized,
)
from automodel_distributed.config import CompileConfig as CompileConfig
from automodel_distributed.config import DDPConfig as DDPConfig
from automodel_distributed.config import DistributedConfig as DistributedConfig
from automodel_distributed.config import FSDP2Config as FSDP2Config
from automodel_distributed.config import MegatronFSDPConfig as MegatronFSDPConfig
from automodel_mesh.version import installed_version

_CHECKPOINT_NAMES = [
    "COMPLETE_MARKER",
    "DEFAULT_KEY_RULES",
    "CheckpointFiles",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "KeyRules",
    "LoadReport",
    "check_hf_checkpoint",
    "checkpoint_key",
    "initialize_model_weights",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_base_model",
    "load_distributed_checkpoint",
    "load_hf_checkpoint",
    "materialize_meta_tensors",
    "read_marker",
    "register_buffer_initializer",
    "reinitialize_non_persistent_buffers",
    "resolve_checkpoint",
    "retie_weights",
    "save_distributed_checkpoint",
    "save_hf_checkpoint",
    "verify_materialized",
]

# The names of __init__.pyi (what type checkers read) load on first access (SPEC 1).
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ += ["__version__", *_CHECKPOINT_NAMES]

__version__ = installed_version("automodel-distributed")
