"""automodel-pipelining: pipeline parallelism for Hugging Face decoder models.

- `PipelineConfig` (``automodel_pipelining.config``): the settings, with NeMo AutoModel's field names.
- `AutoPipeline` (``automodel_pipelining.autopipeline``): splits a model into stages, parallelizes each
  stage with a given ``parallelize_fn`` and runs them with a ``torch.distributed.pipelining`` schedule.

``torch.distributed.pipelining`` is imported only when a pipeline is built.
"""

from automodel_mesh.version import installed_version
from automodel_pipelining.autopipeline import AutoPipeline, PipelineInfo
from automodel_pipelining.config import PipelineConfig
from automodel_pipelining.costs import StageCosts, read_stage_costs
from automodel_pipelining.layout import DecoderLayout, resolve_decoder_layout
from automodel_pipelining.schedules import SCHEDULES, stage_ids_this_rank
from automodel_pipelining.split import (
    calculate_virtual_stages,
    generate_stage_fqns,
    split_layers_by_cost,
    split_layers_evenly,
)
from automodel_pipelining.validate import validate_hf_model_for_pipeline_support

__version__ = installed_version("automodel-pipelining")

__all__ = [
    "SCHEDULES",
    "AutoPipeline",
    "DecoderLayout",
    "PipelineConfig",
    "PipelineInfo",
    "StageCosts",
    "__version__",
    "calculate_virtual_stages",
    "generate_stage_fqns",
    "read_stage_costs",
    "resolve_decoder_layout",
    "split_layers_by_cost",
    "split_layers_evenly",
    "stage_ids_this_rank",
    "validate_hf_model_for_pipeline_support",
]
