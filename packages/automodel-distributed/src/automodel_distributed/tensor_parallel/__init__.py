"""Tensor and sequence parallelism for transformers models: plans as data, a registry, and one apply step.

- `apply_tensor_parallel(model, tp_mesh, tp_plan=None, sequence_parallel=False)` shards a model in place.
- `resolve_tp_plan` picks the plan (user plan > registry > transformers' plan > default decoder plan).
- `enable_async_tensor_parallel(tp_mesh)` turns on torch's micro-pipelined TP (CUDA, compiled blocks).
- `register_tp_plan` / `register_named_tp_plan` add plans; `validate_tensor_parallel` checks head counts.
- Style names for plans are listed in `automodel_distributed.tensor_parallel.styles`.
"""

from automodel_distributed.tensor_parallel.apply import apply_tensor_parallel
from automodel_distributed.tensor_parallel.async_tp import enable_async_tensor_parallel
from automodel_distributed.tensor_parallel.hf_plan import get_hf_tp_shard_plan, translate_hf_tp_plan
from automodel_distributed.tensor_parallel.lora import (
    ColwiseParallelLora,
    RowwiseParallelLora,
    SequenceParallelLora,
    expand_lora_plan,
    is_lora_linear,
    translate_to_lora,
)
from automodel_distributed.tensor_parallel.plans import BUILTIN_TP_PLANS
from automodel_distributed.tensor_parallel.registry import (
    PlanFactory,
    PlanMapping,
    PlanSource,
    register_named_tp_plan,
    register_tp_plan,
)
from automodel_distributed.tensor_parallel.resolve import resolve_tp_plan, sharded_layer_kinds
from automodel_distributed.tensor_parallel.styles import (
    STYLE_NAMES,
    GatherSequenceInput,
    ReplicateBlockInput,
    ReplicatedWithGradAllReduce,
    ReplicateParallel,
    SequenceParallelNorm,
    parallel_style,
)
from automodel_distributed.tensor_parallel.validate import validate_tensor_parallel

__all__ = [
    "BUILTIN_TP_PLANS",
    "STYLE_NAMES",
    "ColwiseParallelLora",
    "GatherSequenceInput",
    "PlanFactory",
    "PlanMapping",
    "PlanSource",
    "ReplicateBlockInput",
    "ReplicateParallel",
    "ReplicatedWithGradAllReduce",
    "RowwiseParallelLora",
    "SequenceParallelLora",
    "SequenceParallelNorm",
    "apply_tensor_parallel",
    "enable_async_tensor_parallel",
    "expand_lora_plan",
    "get_hf_tp_shard_plan",
    "is_lora_linear",
    "parallel_style",
    "register_named_tp_plan",
    "register_tp_plan",
    "resolve_tp_plan",
    "sharded_layer_kinds",
    "translate_hf_tp_plan",
    "translate_to_lora",
    "validate_tensor_parallel",
]
