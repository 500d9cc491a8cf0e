"""Module-tree helpers every automodel package shares (one home for them; torch only, read-only).

Wrappers change module and parameter names without changing the weights: activation checkpointing
inserts ``_checkpoint_wrapped_module.``, ``torch.compile`` ``_orig_mod.``, FSDP1 ``_fsdp_wrapped_module.``
(`WRAPPER_SEGMENTS`). peft wraps a transformers model behind ``get_base_model()`` (`find_hf_model`).
Nothing here mutates a module.
"""

from __future__ import annotations

from torch import nn

__all__ = ["WRAPPER_SEGMENTS", "find_hf_model", "fqn_of", "join_fqn", "strip_wrapper_segments", "unwrap"]

WRAPPER_SEGMENTS: tuple[str, ...] = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
"""Dotted name components that wrappers insert between a module and its parent: torch's
``checkpoint_wrapper``, ``torch.compile`` (``OptimizedModule``) and FSDP1. Every package that compares
names across wrapped and unwrapped models removes exactly these."""


def strip_wrapper_segments(fqn: str) -> str:
    """``fqn`` without the components of `WRAPPER_SEGMENTS` (wherever they appear)."""
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_SEGMENTS)


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside activation-checkpoint, compile, FSDP1 and DDP wrappers (``module`` if none)."""
    from torch.nn.parallel import DistributedDataParallel

    inner = module
    while True:
        if isinstance(inner, DistributedDataParallel):
            inner = inner.module
            continue
        wrapped = next(
            (w for w in (getattr(inner, a, None) for a in WRAPPER_SEGMENTS) if isinstance(w, nn.Module)), None
        )
        if wrapped is None:
            return inner
        inner = wrapped


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name`` without stray dots when either side is empty."""
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}.{name}"


def fqn_of(root: nn.Module, target: nn.Module) -> str | None:
    """The dotted name of ``target`` inside ``root`` (``""`` for ``root`` itself), or None if absent."""
    return next((name for name, sub in root.named_modules() if sub is target), None)


def find_hf_model(model: nn.Module) -> tuple[str, nn.Module]:
    """Find the transformers model inside wrappers that expose ``get_base_model()`` (peft).

    Returns:
        ``(prefix, inner)``: the dotted path of the wrapped model inside ``model`` (``""`` when it is not
        wrapped) and the wrapped model itself.
    """
    prefix, current = "", model
    while True:
        get_base = getattr(current, "get_base_model", None)
        if not callable(get_base):
            return prefix, current
        inner = get_base()
        if inner is current or not isinstance(inner, nn.Module):
            return prefix, current
        path = fqn_of(current, inner)
        if path is None:
            return prefix, current
        prefix, current = join_fqn(prefix, path), inner
