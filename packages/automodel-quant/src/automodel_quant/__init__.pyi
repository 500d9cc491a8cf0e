"""Type stub of the package: its public names (SPEC 1; `lazy_loader.attach_stub` reads the imports)."""

from .bnb import (
    BnBQuantizationConfig,
    apply_bnb_quantization,
    resolve_bnb_targets,
)
from .fp8 import (
    FP8Config,
    apply_fp8_to_model,
    build_fp8_config,
    create_fp8_config_from_dict,
    precompute_fp8_scales_for_fsdp,
    resolve_fp8_targets,
    verify_fp8_conversion,
)
from .qat import (
    QATConfig,
    convert_qat_model,
    disable_fake_quant,
    enable_fake_quant,
    get_disable_fake_quant_fn,
    get_enable_fake_quant_fn,
    get_quantizer_mode,
    prepare_qat_model,
    resolve_qat_layout,
)

__version__: str

__all__ = [
    "BnBQuantizationConfig",
    "FP8Config",
    "QATConfig",
    "__version__",
    "apply_bnb_quantization",
    "apply_fp8_to_model",
    "build_fp8_config",
    "convert_qat_model",
    "create_fp8_config_from_dict",
    "disable_fake_quant",
    "enable_fake_quant",
    "get_disable_fake_quant_fn",
    "get_enable_fake_quant_fn",
    "get_quantizer_mode",
    "precompute_fp8_scales_for_fsdp",
    "prepare_qat_model",
    "resolve_bnb_targets",
    "resolve_fp8_targets",
    "resolve_qat_layout",
    "verify_fp8_conversion",
]
