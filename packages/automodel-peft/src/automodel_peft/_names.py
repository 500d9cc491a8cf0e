"""Parameter and module names: wrapper segments, adapter detection, HF checkpoint keys."""

from __future__ import annotations

__all__ = ["ADAPTER_SEGMENTS", "clean_fqn", "hf_checkpoint_key", "is_adapter_name"]

# Dotted segments that wrappers insert (activation checkpointing, torch.compile, FSDP1).
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
# Submodules / parameters that peft's LoRA layers add next to ``base_layer``.
ADAPTER_SEGMENTS: tuple[str, ...] = (
    "lora_A",
    "lora_B",
    "lora_magnitude_vector",
    "lora_embedding_A",
    "lora_embedding_B",
)


def clean_fqn(fqn: str) -> str:
    """``fqn`` without wrapper segments and a leading DDP ``module.``."""
    parts = [part for part in fqn.split(".") if part not in _WRAPPER_SEGMENTS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def is_adapter_name(fqn: str) -> bool:
    """Whether a parameter or module name lies inside a LoRA adapter (``...lora_A.default.weight``)."""
    return any(part in ADAPTER_SEGMENTS for part in fqn.split("."))


def hf_checkpoint_key(fqn: str) -> str:
    """The key a base parameter has in the model's Hugging Face checkpoint.

    peft keeps the wrapped layer as ``base_layer``: ``model.layers.0.self_attn.q_proj.base_layer.weight``
    is ``model.layers.0.self_attn.q_proj.weight`` in the checkpoint. Wrapper segments are dropped too.
    """
    return ".".join(part for part in clean_fqn(fqn).split(".") if part != "base_layer")
