"""Find modules inside a model and inside its wrappers (reads only).

peft wraps a transformers model behind ``get_base_model()`` (`find_hf_model`); activation checkpointing,
``torch.compile``, FSDP1 and DDP wrap a module in another (`unwrap`).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from automodel_modules.names import WRAPPER_SEGMENTS, join_fqn

__all__ = ["embedding_module", "find_hf_model", "fqn_of", "output_head_fqns", "unwrap"]


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


def embedding_module(model: nn.Module, side: Literal["input", "output"]) -> nn.Module | None:
    """``model.get_input_embeddings()`` / ``get_output_embeddings()`` when it names a module, else None.

    None too where the lookup fails: a model without a head, or a pipeline stage holding a stand-in for
    the side another stage runs, which transformers' automatic lookup does not recognise (it raises
    ``AttributeError`` or ``NotImplementedError`` for some families).
    """
    get = getattr(model, f"get_{side}_embeddings", None)
    if not callable(get):
        return None
    try:
        found = get()
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None


def output_head_fqns(model: nn.Module) -> set[str]:
    """Every name of the output head: ``get_output_embeddings()``, else the modules named ``lm_head``."""
    head = embedding_module(model, "output")
    found = {fqn for fqn, m in model.named_modules() if head is not None and m is head}
    return found or {fqn for fqn, _ in model.named_modules() if fqn.rpartition(".")[2] == "lm_head"}
