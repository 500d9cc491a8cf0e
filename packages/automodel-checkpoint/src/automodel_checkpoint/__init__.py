"""automodel-checkpoint: Hugging Face load/save straight from/to shards, DCP resume (no strategy needed).

- `initialize_model_weights` / `materialize_meta_tensors`: give a meta model storage and initial values.
- `load_hf_checkpoint` / `load_base_model`: read a Hugging Face checkpoint into a sharded model, each rank
  reading only the byte ranges of its own slices (also tensors transformers fuses on load, such as MoE
  experts: `convert`).
- `save_hf_checkpoint`: consolidated safetensors, every rank writing a share of the files (LoRA
  adapters: ``automodel_peft.save_adapters``).
- `save_distributed_checkpoint` / `load_distributed_checkpoint` / `latest_checkpoint` /
  `complete_checkpoints`: resumable torch.distributed.checkpoint snapshots of model and optimizer, on
  any world size; `AsyncCheckpointer` writes them in the background (training waits for the copy to
  host memory only).

The model may be sharded any way torch shards it (``fully_shard``, ``parallelize_module``, DTensor
parameters of any placement); nothing here imports a strategy.

Every save is atomic: written to a temporary sibling folder, completed by a marker (with the SHA-256 of
every file: `file_checksums` / `verify_checkpoint`), then renamed.
"""

from importlib.metadata import PackageNotFoundError, version

from automodel_checkpoint.async_save import AsyncCheckpointer
from automodel_checkpoint.atomic import (
    COMPLETE_MARKER,
    complete_checkpoints,
    is_complete_checkpoint,
    latest_checkpoint,
    read_marker,
)
from automodel_checkpoint.convert import UnsupportedConversionError
from automodel_checkpoint.dcp import (
    CheckpointInfo,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
)
from automodel_checkpoint.files import CheckpointFiles, resolve_checkpoint
from automodel_checkpoint.hf_load import (
    CheckpointMismatchError,
    LoadReport,
    check_hf_checkpoint,
    load_base_model,
    load_hf_checkpoint,
)
from automodel_checkpoint.hf_save import save_hf_checkpoint
from automodel_checkpoint.integrity import file_checksums, verify_checkpoint
from automodel_checkpoint.keys import DEFAULT_KEY_RULES, KeyRules, checkpoint_key
from automodel_checkpoint.materialize import (
    initialize_model_weights,
    materialize_meta_tensors,
    retie_weights,
    verify_materialized,
)
from automodel_checkpoint.recomputed_buffers import (
    register_buffer_initializer,
    reinitialize_non_persistent_buffers,
)
from automodel_checkpoint.safetensors_io import CorruptCheckpointError
from automodel_checkpoint.write_errors import CheckpointWriteError

try:
    __version__ = version("automodel-checkpoint")
except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
    __version__ = "0.0.0"

__all__ = [
    "COMPLETE_MARKER",
    "DEFAULT_KEY_RULES",
    "AsyncCheckpointer",
    "CheckpointFiles",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "KeyRules",
    "LoadReport",
    "UnsupportedConversionError",
    "__version__",
    "check_hf_checkpoint",
    "checkpoint_key",
    "complete_checkpoints",
    "file_checksums",
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
    "verify_checkpoint",
    "verify_materialized",
]
