"""automodel-quant: quantization-aware training, float8 training and quantized base weights.

- `automodel_quant.qat`: `QATConfig`, `prepare_qat_model`, `convert_qat_model`, fake-quant toggles (torchao).
- `automodel_quant.fp8`: `FP8Config`, `apply_fp8_to_model`, `precompute_fp8_scales_for_fsdp` (torchao).
- `automodel_quant.bnb`: `BnBQuantizationConfig`, `apply_bnb_quantization` (bitsandbytes, ``[bnb]`` extra).

Every name is also re-exported here, loaded on first access: ``import automodel_quant`` imports neither
torchao nor bitsandbytes (nor the submodules), so it costs about as much as ``import torch``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from automodel_quant.bnb import BnBQuantizationConfig, apply_bnb_quantization, resolve_bnb_targets
    from automodel_quant.fp8 import (
        FP8Config,
        apply_fp8_to_model,
        build_fp8_config,
        create_fp8_config_from_dict,
        precompute_fp8_scales_for_fsdp,
        resolve_fp8_targets,
        verify_fp8_conversion,
    )
    from automodel_quant.qat import (
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

try:
    __version__ = version("automodel-quant")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0.0.0"

# Public name -> submodule that defines it, imported on first attribute access.
_LAZY = {
    "QATConfig": "automodel_quant.qat",
    "convert_qat_model": "automodel_quant.qat",
    "disable_fake_quant": "automodel_quant.qat",
    "enable_fake_quant": "automodel_quant.qat",
    "get_disable_fake_quant_fn": "automodel_quant.qat",
    "get_enable_fake_quant_fn": "automodel_quant.qat",
    "get_quantizer_mode": "automodel_quant.qat",
    "prepare_qat_model": "automodel_quant.qat",
    "resolve_qat_layout": "automodel_quant.qat",
    "FP8Config": "automodel_quant.fp8",
    "apply_fp8_to_model": "automodel_quant.fp8",
    "build_fp8_config": "automodel_quant.fp8",
    "create_fp8_config_from_dict": "automodel_quant.fp8",
    "precompute_fp8_scales_for_fsdp": "automodel_quant.fp8",
    "resolve_fp8_targets": "automodel_quant.fp8",
    "verify_fp8_conversion": "automodel_quant.fp8",
    "BnBQuantizationConfig": "automodel_quant.bnb",
    "apply_bnb_quantization": "automodel_quant.bnb",
    "resolve_bnb_targets": "automodel_quant.bnb",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
