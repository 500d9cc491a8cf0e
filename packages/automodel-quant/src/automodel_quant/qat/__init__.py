"""Quantization-aware training with torchao: `QATConfig`, prepare / convert, fake-quant toggles.

torchao is imported only when a quantizer is built or a model prepared.
"""

from automodel_quant.qat.config import QAT_MODES, QAT_QUANTIZER_TYPES, QATConfig, UnsupportedLayerPolicy
from automodel_quant.qat.layout import GROUP_SIZES, INNER_K_TILES, LinearShape, QATLayout, resolve_qat_layout
from automodel_quant.qat.prepare import (
    TORCHAO_QAT_MODE,
    convert_qat_model,
    disable_fake_quant,
    enable_fake_quant,
    get_disable_fake_quant_fn,
    get_enable_fake_quant_fn,
    get_quantizer_mode,
    prepare_qat_model,
)

__all__ = [
    "GROUP_SIZES",
    "INNER_K_TILES",
    "QAT_MODES",
    "QAT_QUANTIZER_TYPES",
    "TORCHAO_QAT_MODE",
    "LinearShape",
    "QATConfig",
    "QATLayout",
    "UnsupportedLayerPolicy",
    "convert_qat_model",
    "disable_fake_quant",
    "enable_fake_quant",
    "get_disable_fake_quant_fn",
    "get_enable_fake_quant_fn",
    "get_quantizer_mode",
    "prepare_qat_model",
    "resolve_qat_layout",
]
