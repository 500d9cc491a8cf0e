"""Swap a loaded model's linears for bitsandbytes 4-/8-bit ones (the base of QLoRA).

The decisions (which linears, which device is allowed) are pure functions and run anywhere; the swap
itself needs bitsandbytes and, unless `BnBQuantizationConfig.allow_cpu`, a CUDA device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel_quant._deps import import_bitsandbytes
from automodel_quant._modules import (
    clean_fqn,
    is_adapter_fqn,
    linear_modules,
    output_head_prefixes,
    set_submodule,
    under_prefix,
)
from automodel_quant.bnb.config import BnBQuantizationConfig

__all__ = [
    "BnBPlan",
    "apply_bnb_quantization",
    "check_bnb_device",
    "is_bnb_quantized",
    "resolve_bnb_device",
    "resolve_bnb_targets",
]

logger = logging.getLogger(__name__)

_BNB_LINEARS = ("Linear4bit", "Linear8bitLt")


@dataclass(frozen=True)
class BnBPlan:
    """Which linears `apply_bnb_quantization` swaps, and which it keeps and why."""

    quantize: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)


def _is_bnb_linear(module: nn.Module) -> bool:
    return type(module).__name__ in _BNB_LINEARS and type(module).__module__.startswith("bitsandbytes")


def is_bnb_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds at least one bitsandbytes 4-/8-bit linear (without importing bitsandbytes)."""
    return any(_is_bnb_linear(m) for m in model.modules())


def _matches_skip(fqn: str, patterns: list[str]) -> bool:
    dotted = f".{fqn}."
    return any(fqn == p or fqn.endswith("." + p) or f".{p}." in dotted for p in patterns)


def resolve_bnb_targets(model: nn.Module, config: BnBQuantizationConfig) -> BnBPlan:
    """Decide which linears to quantize. Pure.

    Kept in high precision: the output head (as transformers does), ``llm_int8_skip_modules`` (leaf
    name, dotted suffix or full name), LoRA adapter layers, and linears already quantized.
    """
    head = output_head_prefixes(model)
    quantize: list[str] = []
    skipped: dict[str, str] = {}
    for fqn, module in linear_modules(model):
        name = clean_fqn(fqn)
        if _is_bnb_linear(module):
            continue
        if is_adapter_fqn(name):
            skipped[fqn] = "LoRA adapter"
        elif under_prefix(fqn, head):
            skipped[fqn] = "output head"
        elif _matches_skip(name, config.llm_int8_skip_modules):
            skipped[fqn] = "in llm_int8_skip_modules"
        else:
            quantize.append(fqn)
    return BnBPlan(quantize=tuple(quantize), skipped=skipped)


def resolve_bnb_device(device: torch.device | str | None) -> torch.device:
    """The device to quantize on: ``device``, else ``cuda`` (the current one) when available, else ``cpu``."""
    if device is not None:
        return torch.device(device)
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def check_bnb_device(config: BnBQuantizationConfig, device: torch.device) -> None:
    """Refuse a device bitsandbytes quantization cannot (or, by config, may not) use.

    Raises:
        RuntimeError: CUDA requested but unavailable; a CPU device without ``config.allow_cpu``; any
            other device type.
    """
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "bitsandbytes quantization needs CUDA, and torch.cuda.is_available() is False on this host"
            )
        return
    if device.type == "cpu":
        if not config.allow_cpu:
            raise RuntimeError(
                "bitsandbytes quantization needs CUDA: this host has no CUDA device (quantizing on cpu). Run "
                "on a GPU, or set BnBQuantizationConfig(allow_cpu=True) to use bitsandbytes' slow CPU "
                "backend (bitsandbytes >= 0.47)"
            )
        return
    raise RuntimeError(f"bitsandbytes quantization runs on cuda (or cpu with allow_cpu=True), not {device}")


def _quantized_linear(bnb: Any, linear: nn.Linear, config: BnBQuantizationConfig) -> nn.Module:
    weight = linear.weight.detach()
    bias = linear.bias
    nn_ = bnb.nn
    if config.load_in_4bit:
        new = nn_.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=bias is not None,
            compute_dtype=config.bnb_4bit_compute_dtype,
            compress_statistics=config.bnb_4bit_use_double_quant,
            quant_type=config.bnb_4bit_quant_type,
            quant_storage=config.bnb_4bit_quant_storage,
            device="meta",
        )
        new.weight = nn_.Params4bit(
            weight.to(config.bnb_4bit_compute_dtype),
            requires_grad=False,
            compress_statistics=config.bnb_4bit_use_double_quant,
            quant_type=config.bnb_4bit_quant_type,
            quant_storage=config.bnb_4bit_quant_storage,
        )
    else:
        new = nn_.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=bias is not None,
            has_fp16_weights=False,
            threshold=config.llm_int8_threshold,
            device="meta",
        )
        new.weight = nn_.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        new.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return new


def apply_bnb_quantization(
    model: nn.Module, config: BnBQuantizationConfig, *, device: torch.device | str | None = None
) -> nn.Module:
    """Replace the model's linears with bitsandbytes 4-/8-bit ones and quantize their weights, in place.

    Preconditions: real (not meta) weights, already loaded: bitsandbytes quantizes actual values; the
    model is not sharded. The swapped layers end up on ``device`` (quantization happens on the move);
    other modules are not moved. For models loaded by transformers, passing
    ``BitsAndBytesConfig(**config.to_hf_kwargs())`` to ``from_pretrained`` does the same while loading.

    Mutates ``model``: swapped modules; ``model.is_loaded_in_4bit`` / ``is_loaded_in_8bit`` (which peft
    reads to build its bitsandbytes LoRA layers) and ``model.bnb_quantization_config``.

    Args:
        model: The model.
        config: The quantization config.
        device: Where to quantize; default the current CUDA device, else cpu (see ``allow_cpu``).

    Returns:
        ``model``.

    Raises:
        RuntimeError: No CUDA (and not ``allow_cpu``), see `check_bnb_device`.
        ImportError: bitsandbytes is not installed (``pip install automodel-quant[bnb]``).
        ValueError: Meta-device weights.
    """
    target = resolve_bnb_device(device)
    check_bnb_device(config, target)
    bnb = import_bitsandbytes("apply_bnb_quantization")
    plan = resolve_bnb_targets(model, config)
    meta = [fqn for fqn in plan.quantize if model.get_submodule(fqn).weight.is_meta]
    if meta:
        raise ValueError(
            f"apply_bnb_quantization needs loaded weights, but {meta[0]} (and {len(meta) - 1} more) are on "
            "the meta device: load the base model first (bitsandbytes quantizes real values)"
        )
    for fqn in plan.quantize:
        linear = model.get_submodule(fqn)
        assert isinstance(linear, nn.Linear)
        set_submodule(model, fqn, _quantized_linear(bnb, linear, config).to(target))
    marks = {
        "is_loaded_in_4bit": config.load_in_4bit,
        "is_loaded_in_8bit": config.load_in_8bit,
        "bnb_quantization_config": config,
    }
    for name, value in marks.items():
        setattr(model, name, value)
    logger.info(
        "bitsandbytes %d-bit: %d linears quantized on %s, %d kept (%s)",
        config.bits,
        len(plan.quantize),
        target,
        len(plan.skipped),
        ", ".join(sorted(set(plan.skipped.values()))) or "-",
    )
    return model
