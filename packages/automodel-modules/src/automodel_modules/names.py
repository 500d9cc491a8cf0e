"""Names across wrappers, and the one rule of which parameters are adapters (nothing here mutates).

Wrappers change module and parameter names without changing the weights: activation checkpointing
inserts ``_checkpoint_wrapped_module.``, ``torch.compile`` ``_orig_mod.``, FSDP1 ``_fsdp_wrapped_module.``
(`WRAPPER_SEGMENTS`). peft keeps LoRA weights in sub-modules named as in `ADAPTER_SEGMENTS`: the one
rule, for every package, of which parameters are adapters (automodel-peft owns what is done with them).
"""

from __future__ import annotations

__all__ = ["ADAPTER_SEGMENTS", "WRAPPER_SEGMENTS", "is_adapter_fqn", "join_fqn", "strip_wrapper_segments"]

WRAPPER_SEGMENTS: tuple[str, ...] = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
"""Dotted name components that wrappers insert between a module and its parent: torch's
``checkpoint_wrapper``, ``torch.compile`` (``OptimizedModule``) and FSDP1. Every package that compares
names across wrapped and unwrapped models removes exactly these."""

ADAPTER_SEGMENTS: tuple[str, ...] = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
)
"""The sub-modules that hold a peft LoRA layer's adapter weights: exactly what peft declares as
``LoraLayer.adapter_layer_names`` (automodel-peft's tests check the two agree)."""


def is_adapter_fqn(fqn: str) -> bool:
    """Whether a parameter or module name lies inside a LoRA adapter (``...q_proj.lora_A.default.weight``)."""
    return any(part in ADAPTER_SEGMENTS for part in fqn.split("."))


def strip_wrapper_segments(fqn: str) -> str:
    """``fqn`` without the components of `WRAPPER_SEGMENTS` (wherever they appear)."""
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_SEGMENTS)


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name`` without stray dots when either side is empty."""
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}.{name}"
