"""Float8 training with torchao: `FP8Config`, `apply_fp8_to_model`, the FSDP2 post-optimizer hook.

torchao is imported only when a model is converted.
"""

from automodel_quant.fp8.apply import (
    apply_fp8_to_model,
    precompute_fp8_scales_for_fsdp,
    verify_fp8_conversion,
)
from automodel_quant.fp8.config import FP8_RECIPES, FP8Config, build_fp8_config, create_fp8_config_from_dict
from automodel_quant.fp8.plan import FP8Plan, resolve_fp8_targets

__all__ = [
    "FP8_RECIPES",
    "FP8Config",
    "FP8Plan",
    "apply_fp8_to_model",
    "build_fp8_config",
    "create_fp8_config_from_dict",
    "precompute_fp8_scales_for_fsdp",
    "resolve_fp8_targets",
    "verify_fp8_conversion",
]
