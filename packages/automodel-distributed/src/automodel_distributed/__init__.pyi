"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports).

The checkpoint names are automodel-checkpoint's, imported eagerly by ``__init__.py`` (the stub loader
takes relative imports only, so they are declared as aliases of that module's names).
"""

import automodel_checkpoint as _checkpoint

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
from .vocab_parallel_loss import vocab_parallel_cross_entropy

COMPLETE_MARKER = _checkpoint.COMPLETE_MARKER
DEFAULT_KEY_RULES = _checkpoint.DEFAULT_KEY_RULES
CheckpointFiles = _checkpoint.CheckpointFiles
CheckpointInfo = _checkpoint.CheckpointInfo
CheckpointMismatchError = _checkpoint.CheckpointMismatchError
CorruptCheckpointError = _checkpoint.CorruptCheckpointError
KeyRules = _checkpoint.KeyRules
LoadReport = _checkpoint.LoadReport
check_hf_checkpoint = _checkpoint.check_hf_checkpoint
checkpoint_key = _checkpoint.checkpoint_key
initialize_model_weights = _checkpoint.initialize_model_weights
is_complete_checkpoint = _checkpoint.is_complete_checkpoint
latest_checkpoint = _checkpoint.latest_checkpoint
load_base_model = _checkpoint.load_base_model
load_distributed_checkpoint = _checkpoint.load_distributed_checkpoint
load_hf_checkpoint = _checkpoint.load_hf_checkpoint
materialize_meta_tensors = _checkpoint.materialize_meta_tensors
read_marker = _checkpoint.read_marker
register_buffer_initializer = _checkpoint.register_buffer_initializer
reinitialize_non_persistent_buffers = _checkpoint.reinitialize_non_persistent_buffers
resolve_checkpoint = _checkpoint.resolve_checkpoint
retie_weights = _checkpoint.retie_weights
save_distributed_checkpoint = _checkpoint.save_distributed_checkpoint
save_hf_checkpoint = _checkpoint.save_hf_checkpoint
verify_materialized = _checkpoint.verify_materialized

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
    "vocab_parallel_cross_entropy",
]
