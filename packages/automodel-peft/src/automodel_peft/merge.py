"""Fold adapters into the base weights and drop the LoRA layers (for export or inference)."""

from __future__ import annotations

from typing import Any

from torch import nn

from automodel_modules import is_dtensor
from automodel_peft.apply import ADAPTER_STATE_ATTR
from automodel_peft.lora_layers import lora_layers

__all__ = ["merge_adapters"]


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_fqn, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    setattr(parent, name, module)


def merge_adapters(model: nn.Module, *, safe_merge: bool = True) -> nn.Module:
    """Add every adapter's update to its base weight and put the plain base layers back, in place.

    Afterwards the model has its original module classes and parameter names (``...q_proj.weight``), so
    ``save_pretrained`` writes an ordinary transformers checkpoint. DoRA adapters merge with their
    magnitudes. Dropout plays no part (merging is an inference-time operation).

    Preconditions: an unsharded model with real weights (gather a sharded model's full state dict into a
    plain adapted model first); base weights not quantized (peft would dequantize them; re-quantize
    afterwards if you must).

    Args:
        model: An adapted model (by `apply_lora`, or a ``peft.PeftModel``, which is unwrapped too).
        safe_merge: Check the merged weights for NaNs/infs (peft's ``safe_merge``).

    Returns:
        The merged model (for a ``PeftModel``, its base model).

    Raises:
        ValueError: No adapters, DTensor (sharded) or meta parameters.
    """
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            "merge_adapters needs an unsharded model: save the adapters (save_adapters) or gather a full "
            "state dict into a plain adapted model, then merge"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("merge_adapters needs real weights, but the model has parameters on the meta device")
    merge_and_unload = getattr(model, "merge_and_unload", None)
    if callable(merge_and_unload) and type(model).__name__.startswith("PeftModel"):
        merged: nn.Module = merge_and_unload(safe_merge=safe_merge)
        return merged
    layers: dict[str, Any] = {name: layer for name, layer, _ in lora_layers(model)}
    if not layers:
        raise ValueError("merge_adapters: the model has no LoRA adapters")
    for name, layer in layers.items():
        layer.merge(safe_merge=safe_merge)
        _set_submodule(model, name, layer.get_base_layer())
    for attr in ("peft_config", ADAPTER_STATE_ATTR):
        if attr in model.__dict__:
            delattr(model, attr)
    return model
