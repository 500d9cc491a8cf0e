"""automodel-modules: module-tree tools every automodel package shares (depends on torch only).

- `automodel_modules.names`: names across wrappers (`WRAPPER_SEGMENTS`) and the adapter rule
  (`ADAPTER_SEGMENTS`);
- `automodel_modules.lookup`: the transformers model inside peft, the module inside wrappers, FQNs;
- `automodel_modules.kinds`: DTensors, ``Conv1D``, linear-like maps, asked without importing them;
- `automodel_modules.fsdp_units`: reshard every FSDP2 unit of a model;
- `automodel_modules.dataflow`: what each tensor of a fake-tensor forward is computed from (the tracer
  that tensor, context and pipeline parallelism read a model's structure with);
- `automodel_modules.fake_mode`: ``FakeTensorMode`` with the meta kernels an older torch lacks (every
  fake-tensor forward of the packages runs under it);
- `automodel_modules.devices`: `collective_device`, the device a collective's tensors are made on;
- `automodel_modules.sequence_shards`: the mark sequence parallelism leaves for pipeline stages.
"""

from importlib.metadata import PackageNotFoundError, version

from automodel_modules.devices import collective_device
from automodel_modules.fsdp_units import reshard_fsdp_units
from automodel_modules.kinds import is_conv1d, is_dtensor, maps_like_linear
from automodel_modules.lookup import embedding_module, find_hf_model, fqn_of, output_head_fqns, unwrap
from automodel_modules.names import (
    ADAPTER_SEGMENTS,
    WRAPPER_SEGMENTS,
    is_adapter_fqn,
    join_fqn,
    strip_wrapper_segments,
)
from automodel_modules.sequence_shards import (
    mark_sequence_shards,
    mark_stream_continues,
    sequence_shards,
    stream_continues,
)

try:
    __version__ = version("automodel-modules")
except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
    __version__ = "0.0.0"

__all__ = [
    "ADAPTER_SEGMENTS",
    "WRAPPER_SEGMENTS",
    "__version__",
    "collective_device",
    "embedding_module",
    "find_hf_model",
    "fqn_of",
    "is_adapter_fqn",
    "is_conv1d",
    "is_dtensor",
    "join_fqn",
    "maps_like_linear",
    "mark_sequence_shards",
    "mark_stream_continues",
    "output_head_fqns",
    "reshard_fsdp_units",
    "sequence_shards",
    "stream_continues",
    "strip_wrapper_segments",
    "unwrap",
]
