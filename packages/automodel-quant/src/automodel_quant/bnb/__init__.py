"""4-/8-bit base weights through bitsandbytes (the ``[bnb]`` extra; CUDA, or CPU when allowed)."""

from automodel_quant.bnb.apply import (
    BnBPlan,
    apply_bnb_quantization,
    check_bnb_device,
    is_bnb_quantized,
    resolve_bnb_device,
    resolve_bnb_targets,
)
from automodel_quant.bnb.config import BNB_4BIT_QUANT_TYPES, BnBQuantizationConfig

__all__ = [
    "BNB_4BIT_QUANT_TYPES",
    "BnBPlan",
    "BnBQuantizationConfig",
    "apply_bnb_quantization",
    "check_bnb_device",
    "is_bnb_quantized",
    "resolve_bnb_device",
    "resolve_bnb_targets",
]
