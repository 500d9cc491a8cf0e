"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from .checkpoint import (
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
    verify_materialized,
)
from .config import (
    CompileConfig,
    DDPConfig,
    DistributedConfig,
    FSDP2Config,
    MegatronFSDPConfig,
)
from .ddp import DDPManager
from .fsdp2 import FSDP2Manager
from .loss import MaskedCrossEntropy
from .megatron_fsdp import MegatronFSDPManager
from .multimodal import FreezeConfig, ModelParts, apply_freeze_config, model_parts
from .strategy import NoStrategy, StrategyManager, as_strategy

__version__: str

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
    "FreezeConfig",
    "KeyRules",
    "LoadReport",
    "MaskedCrossEntropy",
    "MegatronFSDPConfig",
    "MegatronFSDPManager",
    "ModelParts",
    "NoStrategy",
    "StrategyManager",
    "__version__",
    "apply_freeze_config",
    "as_strategy",
    "check_hf_checkpoint",
    "checkpoint_key",
    "initialize_model_weights",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_base_model",
    "load_distributed_checkpoint",
    "load_hf_checkpoint",
    "materialize_meta_tensors",
    "model_parts",
    "read_marker",
    "register_buffer_initializer",
    "reinitialize_non_persistent_buffers",
    "resolve_checkpoint",
    "retie_weights",
    "save_distributed_checkpoint",
    "save_hf_checkpoint",
    "verify_materialized",
]
