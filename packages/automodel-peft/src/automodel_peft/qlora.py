"""QLoRA: LoRA on bitsandbytes-quantized base weights, through automodel-quant (the ``[quant]`` extra)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

__all__ = ["create_bnb_config", "prepare_quantized_base", "quant_module"]

_INSTALL = "pip install automodel-peft[quant]"


def quant_module() -> ModuleType:
    """``automodel_quant.bnb``, imported on demand.

    Raises:
        ImportError: automodel-quant is not installed; the message names
            ``pip install automodel-peft[quant]``.
    """
    try:
        return importlib.import_module("automodel_quant.bnb")
    except ImportError as exc:
        raise ImportError(
            f"LoRA on quantized base weights (QLoRA) needs automodel-quant, which is not installed ({exc}); "
            f"install it with `{_INSTALL}` (and bitsandbytes with `pip install automodel-quant[bnb]`)"
        ) from exc


def _as_bnb_config(quantization_config: object) -> Any:
    bnb = quant_module()
    if isinstance(quantization_config, bnb.BnBQuantizationConfig):
        return quantization_config
    if isinstance(quantization_config, Mapping):
        return bnb.BnBQuantizationConfig.from_dict(quantization_config)
    hf_kwargs = getattr(quantization_config, "to_dict", None)
    if type(quantization_config).__name__ == "BitsAndBytesConfig" and callable(hf_kwargs):
        known = set(bnb.BnBQuantizationConfig.__dataclass_fields__)
        data = {k: v for k, v in hf_kwargs().items() if k in known}
        return bnb.BnBQuantizationConfig.from_dict(data)
    raise ValueError(
        "quantization_config must be an automodel_quant.bnb.BnBQuantizationConfig (or its dict, or a "
        f"transformers BitsAndBytesConfig), got {type(quantization_config).__name__}"
    )


def prepare_quantized_base(model: nn.Module, quantization_config: object, *, use_dora: bool) -> torch.dtype:
    """Make sure ``model``'s base linears are bitsandbytes-quantized; return the adapters' default dtype.

    A model already holding bitsandbytes layers (e.g. loaded by transformers with a
    ``BitsAndBytesConfig``) is left as it is; otherwise `automodel_quant.bnb.apply_bnb_quantization`
    quantizes it (which needs CUDA unless the config allows CPU).

    Raises:
        ImportError: automodel-quant (``pip install automodel-peft[quant]``) or bitsandbytes is missing.
        ValueError: DoRA (not supported on quantized weights), weights on the meta device, a bad config.
        RuntimeError: No CUDA device (from automodel-quant).
    """
    bnb = quant_module()
    config = _as_bnb_config(quantization_config)
    if use_dora:
        raise ValueError(
            "DoRA on bitsandbytes-quantized base weights is not supported; use plain LoRA (use_dora=False) "
            "for QLoRA"
        )
    if not bnb.is_bnb_quantized(model):
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(
                "QLoRA needs the base weights loaded before LoRA is applied (bitsandbytes quantizes real "
                "values); build the model on a real device and load it, or load it with a BitsAndBytesConfig"
            )
        bnb.apply_bnb_quantization(model, config)
    # peft reads these to build its bitsandbytes LoRA layers.
    marks = {"is_loaded_in_4bit": config.load_in_4bit, "is_loaded_in_8bit": config.load_in_8bit}
    for name, value in marks.items():
        setattr(model, name, value)
    dtype: torch.dtype = config.compute_dtype
    return dtype


def create_bnb_config(config: object) -> Any:
    """A ``transformers.BitsAndBytesConfig`` for ``from_pretrained(..., quantization_config=...)``.

    Args:
        config: A `BnBQuantizationConfig` or its dict (the reference system's parameter name).

    Raises:
        ImportError: automodel-quant is missing (``pip install automodel-peft[quant]``).
    """
    bnb_config = _as_bnb_config(config)
    import transformers

    return transformers.BitsAndBytesConfig(**bnb_config.to_hf_kwargs())
