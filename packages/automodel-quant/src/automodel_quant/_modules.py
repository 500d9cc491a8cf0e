"""Module-tree helpers shared by QAT, FP8 and bitsandbytes: names, linears, the output head, swaps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import nn

from automodel_modules import is_adapter_fqn, output_head_fqns, strip_wrapper_segments

__all__ = [
    "clean_fqn",
    "is_adapter_fqn",
    "linear_modules",
    "output_head_prefixes",
    "parameter_dtypes",
    "set_submodule",
    "shielded",
    "under_prefix",
]

# The name rules every package shares: wrapper segments, and which sub-modules are LoRA adapters.
clean_fqn = strip_wrapper_segments


def under_prefix(fqn: str, prefixes: Iterable[str]) -> bool:
    """Whether ``fqn`` is one of ``prefixes`` or a descendant of one."""
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def linear_modules(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` (subclasses included) with its dotted name, in module order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]


def output_head_prefixes(model: nn.Module) -> set[str]:
    """Dotted names of the model's output head: ``get_output_embeddings()``, else modules named ``lm_head``.

    A LoRA-wrapped head is covered with everything inside it (``lm_head.base_layer`` included).
    """
    found = output_head_fqns(model)
    # A peft wrapper's get_output_embeddings may return the inner base layer: use its wrapper.
    return {fqn.removesuffix(".base_layer") for fqn in found}


def parameter_dtypes(model: nn.Module) -> dict[str, list[str]]:
    """Parameter names grouped by dtype name (``"float32"`` -> names)."""
    out: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        out.setdefault(str(param.dtype).removeprefix("torch."), []).append(name)
    return out


def set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    """Replace the submodule at ``fqn`` (non-empty) with ``module``."""
    parent_fqn, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    setattr(parent, name, module)


class _Shield(nn.Module):
    """Stands in for a module during a module swap; holds it outside the module tree, so it is not seen."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)


@contextlib.contextmanager
def shielded(model: nn.Module, fqns: Iterable[str]) -> Iterator[None]:
    """Hide the modules at ``fqns`` from a tree walk (e.g. a quantizer's module swap) for the block.

    Each module is replaced by a child-less placeholder and put back afterwards, even on error.
    """
    hidden: list[tuple[str, nn.Module]] = []
    try:
        for fqn in sorted(set(fqns), key=lambda f: f.count("."), reverse=True):
            module = model.get_submodule(fqn)
            set_submodule(model, fqn, _Shield(module))
            hidden.append((fqn, module))
        yield
    finally:
        for fqn, module in reversed(hidden):
            set_submodule(model, fqn, module)
