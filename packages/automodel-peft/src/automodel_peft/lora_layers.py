"""Walk peft LoRA layers and their adapters without caring how the model is wrapped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["lora_layers"]


def lora_layers(model: nn.Module, adapter_name: str | None = None) -> Iterator[tuple[str, Any, str]]:
    """Yield ``(name, layer, adapter)`` for every adapter of every peft LoRA layer, in module order.

    A LoRA layer is anything with a ``base_layer`` module and ``lora_A`` / ``lora_B`` ``ModuleDict``s
    (peft's ``lora.Linear`` and its bitsandbytes variants). ``name`` is the module's name in ``model``
    (with any wrapper segments; see `clean_fqn`).
    """
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not (
            isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(lora_a, nn.ModuleDict)
        ):
            continue
        for adapter in lora_a:
            if adapter_name is None or adapter == adapter_name:
                yield name, module, adapter
