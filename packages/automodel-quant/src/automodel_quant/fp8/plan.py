"""Which linears FP8 training converts: a pure decision over the module tree (no torchao import)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from automodel_quant._modules import (
    clean_fqn,
    is_adapter_fqn,
    linear_modules,
    output_head_prefixes,
    under_prefix,
)
from automodel_quant.fp8.config import FP8Config

__all__ = ["FP8Plan", "resolve_fp8_targets"]


@dataclass(frozen=True)
class FP8Plan:
    """The outcome of the FP8 module filter.

    Attributes:
        convert: Linears to convert.
        unsupported_dims: Linears left out because a weight dim does not divide by 16 -> their shape.
        excluded: Linears left out by policy -> why (output head, adapter, ``filter_fqns``).
    """

    convert: tuple[str, ...]
    unsupported_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)


def resolve_fp8_targets(model: nn.Module, config: FP8Config) -> FP8Plan:
    """Decide, without changing anything, which linear layers `apply_fp8_to_model` converts.

    Rules, in order: LoRA adapter layers are kept (rank-sized matmuls gain nothing); the output head is
    kept unless ``config.convert_output_head``; an FQN containing one of ``config.filter_fqns`` is kept;
    a weight whose dims do not both divide by 16 is kept (float8 matmuls need multiples of 16). Layers
    already converted are ignored.
    """
    head = set() if config.convert_output_head else output_head_prefixes(model)
    convert: list[str] = []
    dims: dict[str, tuple[int, ...]] = {}
    excluded: dict[str, str] = {}
    for fqn, module in linear_modules(model):
        if type(module).__name__ == "Float8Linear":
            continue
        name = clean_fqn(fqn)
        if is_adapter_fqn(name):
            excluded[fqn] = "LoRA adapter"
        elif under_prefix(fqn, head):
            excluded[fqn] = "output head (set convert_output_head=True to convert it)"
        elif any(pattern in name for pattern in config.filter_fqns):
            excluded[fqn] = "matches filter_fqns"
        elif any(d % 16 for d in module.weight.shape):
            dims[fqn] = tuple(module.weight.shape)
        else:
            convert.append(fqn)
    return FP8Plan(convert=tuple(convert), unsupported_dims=dims, excluded=excluded)
