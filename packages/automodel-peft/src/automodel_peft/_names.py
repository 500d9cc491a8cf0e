"""Parameter and module names of adapted models: wrapper segments, adapter detection, HF checkpoint keys.

The rules themselves (`ADAPTER_SEGMENTS`, the wrapper segments) live in ``automodel_modules``, the
one home every package reads them from.
"""

from __future__ import annotations

from automodel_modules import ADAPTER_SEGMENTS, is_adapter_fqn, strip_wrapper_segments

__all__ = ["ADAPTER_SEGMENTS", "clean_fqn", "hf_checkpoint_key", "is_adapter_name"]

is_adapter_name = is_adapter_fqn


def clean_fqn(fqn: str) -> str:
    """``fqn`` without wrapper segments and a leading DDP ``module.``."""
    parts = strip_wrapper_segments(fqn).split(".")
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def hf_checkpoint_key(fqn: str) -> str:
    """The key a base parameter has in the model's Hugging Face checkpoint.

    peft keeps the wrapped layer as ``base_layer``: ``model.layers.0.self_attn.q_proj.base_layer.weight``
    is ``model.layers.0.self_attn.q_proj.weight`` in the checkpoint. Wrapper segments are dropped too.
    """
    return ".".join(part for part in clean_fqn(fqn).split(".") if part != "base_layer")
