"""Module-tree and tensor helpers every automodel package shares (one home for them; torch only).

Wrappers change module and parameter names without changing the weights: activation checkpointing
inserts ``_checkpoint_wrapped_module.``, ``torch.compile`` ``_orig_mod.``, FSDP1 ``_fsdp_wrapped_module.``
(`WRAPPER_SEGMENTS`). peft wraps a transformers model behind ``get_base_model()`` (`find_hf_model`) and
keeps LoRA weights in sub-modules named as in `ADAPTER_SEGMENTS`: the one rule, for every package, of
which parameters are adapters (automodel-peft owns what is done with them). Nothing here mutates a module.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "ADAPTER_SEGMENTS",
    "WRAPPER_SEGMENTS",
    "find_hf_model",
    "fqn_of",
    "is_adapter_fqn",
    "is_conv1d",
    "is_dtensor",
    "join_fqn",
    "maps_like_linear",
    "output_head_fqns",
    "strip_wrapper_segments",
    "unwrap",
]

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


def output_head_fqns(model: nn.Module) -> set[str]:
    """Every name of the output head: ``get_output_embeddings()``, else the modules named ``lm_head``."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = None
    if callable(get_head):
        try:
            head = get_head()
        except (AttributeError, NotImplementedError):  # models without a head
            head = None
    found = {fqn for fqn, m in model.named_modules() if head is not None and m is head}
    return found or {fqn for fqn, _ in model.named_modules() if fqn.rpartition(".")[2] == "lm_head"}


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a ``DTensor``, without importing ``torch.distributed.tensor``.

    That import costs seconds; if nothing imported it yet, nothing can be a DTensor, so single-process
    code paths never pay for it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear, its weight stored ``[in, out]``).

    Read from ``sys.modules`` (mesh does not depend on transformers): a ``Conv1D`` exists only once
    transformers defined it.
    """
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    return isinstance(conv1d, type) and isinstance(module, conv1d)


def maps_like_linear(module: nn.Module, in_features: int, out_features: int) -> bool:
    """Whether one call of ``module`` maps ``(..., in_features)`` to a tensor ``(..., out_features)``.

    For linear subclasses with a forward of their own (torchao's ``Float8Linear``, Falcon's linear): the
    call runs on fake tensors (no compute, no memory, meta weights included), its input on the weight's
    device. A block-diagonal grouped projection that only borrows the weight gives another shape or
    fails; a router returns a tuple. Either way it is not a linear map that sharding or a low-rank delta
    of the weight's shape could treat as one.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    weight = getattr(module, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = module(torch.empty(2, 3, in_features, device=device))
    except Exception:  # it cannot take (..., in): not a plain linear map
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, 3, out_features)
