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
    from automodel_distributed.checkpoint import (
        COMPLETE_MARKER,
        DEFAULT_KEY_RULES,
        CheckpointFiles,
        CheckpointInfo,
        CheckpointMismatchError,
        CorruptCheckpointError,
        KeyRules,
        LoadReport,
        check_hf_checkpoint,
        checkpoint_key,
        initialize_model_weights,
        is_complete_checkpoint,
        latest_checkpoint,
        load_base_model,
        load_distributed_checkpoint,
        load_hf_checkpoint,
        materialize_meta_tensors,
        read_marker,
        register_buffer_initializer,
        reinitialize_non_persistent_buffers,
        resolve_checkpoint,
        retie_weights,
        save_distributed_checkpoint,
        save_hf_checkpoint,
        save_peft_adapters,
        verify_materialized,
    )
    from automodel_distributed.ddp import DDPManager
    from automodel_distributed.fsdp2 import FSDP2Manager
    from automodel_distributed.loss import MaskedCrossEntropy
    from automodel_distributed.megatron_fsdp import MegatronFSDPManager

try:
    __version__ = version("automodel-distributed")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"

# Public name -> module that defines it, imported on first attribute access.
_LAZY = {
    "FSDP2Manager": "automodel_distributed.fsdp2",
    "DDPManager": "automodel_distributed.ddp",
    "MaskedCrossEntropy": "automodel_distributed.loss",
    "MegatronFSDPManager": "automodel_distributed.megatron_fsdp",
    # Checkpoint load / save (automodel_distributed.checkpoint).
    "COMPLETE_MARKER": "automodel_distributed.checkpoint",
    "DEFAULT_KEY_RULES": "automodel_distributed.checkpoint",
    "CheckpointFiles": "automodel_distributed.checkpoint",
    "CheckpointInfo": "automodel_distributed.checkpoint",
    "CheckpointMismatchError": "automodel_distributed.checkpoint",
    "CorruptCheckpointError": "automodel_distributed.checkpoint",
    "KeyRules": "automodel_distributed.checkpoint",
    "LoadReport": "automodel_distributed.checkpoint",
    "check_hf_checkpoint": "automodel_distributed.checkpoint",
    "checkpoint_key": "automodel_distributed.checkpoint",
    "initialize_model_weights": "automodel_distributed.checkpoint",
    "is_complete_checkpoint": "automodel_distributed.checkpoint",
    "latest_checkpoint": "automodel_distributed.checkpoint",
    "load_base_model": "automodel_distributed.checkpoint",
    "load_distributed_checkpoint": "automodel_distributed.checkpoint",
    "load_hf_checkpoint": "automodel_distributed.checkpoint",
    "materialize_meta_tensors": "automodel_distributed.checkpoint",
    "read_marker": "automodel_distributed.checkpoint",
    "register_buffer_initializer": "automodel_distributed.checkpoint",
    "reinitialize_non_persistent_buffers": "automodel_distributed.checkpoint",
    "resolve_checkpoint": "automodel_distributed.checkpoint",
    "retie_weights": "automodel_distributed.checkpoint",
    "save_distributed_checkpoint": "automodel_distributed.checkpoint",
    "save_hf_checkpoint": "automodel_distributed.checkpoint",
    "save_peft_adapters": "automodel_distributed.checkpoint",
    "verify_materialized": "automodel_distributed.checkpoint",
}

__all__ = [
    "COMPLETE_MARKER",
    "DEFAULT_KEY_RULES",
    "CheckpointFiles",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CompileConfig",
    "CorruptCheckpointError",
    "DDPConfig",
    "DDPManager",
    "DistributedConfig",
    "FSDP2Config",
    "FSDP2Manager",
    "KeyRules",
    "LoadReport",
    "MaskedCrossEntropy",
    "MegatronFSDPConfig",
    "MegatronFSDPManager",
    "__version__",
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
    "save_peft_adapters",
    "verify_materialized",
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
