"""Module lookup by plan key, with the matching rules of ``parallelize_module``.

A plan key is a dotted module path; each dot-separated token is an ``fnmatch`` pattern matched against
the child names one level down (so ``layers.*.mlp`` matches ``layers.0.mlp``, ``layers.1.mlp``, ...).
The empty key is the root module.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

__all__ = ["find_hf_model", "join_fqn", "match_modules"]


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name`` without stray dots when either side is empty."""
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}.{name}"


def match_modules(root: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """Every ``(fqn, module)`` that ``parallelize_module(root, mesh, {key: style})`` would apply to.

    Args:
        root: The module the plan is applied to.
        key: A plan key (a dotted path of ``fnmatch`` tokens; ``""`` is the root).

    Returns:
        The matches in module order, with their concrete dotted names.
    """
    if key == "":
        return [("", root)]
    found: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str, tokens: list[str]) -> None:
        token, rest = tokens[0], tokens[1:]
        for name, child in module.named_children():
            if not fnmatch(name, token):
                continue
            fqn = join_fqn(prefix, name)
            if rest:
                walk(child, fqn, rest)
            else:
                found.append((fqn, child))

    walk(root, "", key.split("."))
    return found


def find_hf_model(model: nn.Module) -> tuple[str, nn.Module]:
    """Find the model that plans describe inside wrappers that expose ``get_base_model()`` (peft).

    Args:
        model: The module handed to the tensor-parallel functions.

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
        path = next((name for name, sub in current.named_modules() if sub is inner), None)
        if path is None:
            return prefix, current
        prefix, current = join_fqn(prefix, path), inner
