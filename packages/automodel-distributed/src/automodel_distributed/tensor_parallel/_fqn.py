"""Module lookup by plan key, with the matching rules of ``parallelize_module``.

A plan key is a dotted module path; each dot-separated token is an ``fnmatch`` pattern matched against
the child names one level down (so ``layers.*.mlp`` matches ``layers.0.mlp``, ``layers.1.mlp``, ...).
The empty key is the root module.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from automodel_modules import join_fqn

__all__ = ["match_modules", "param_module_names"]


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


def param_module_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s sub-modules holding parameters, a LoRA-wrapped linear counted as itself.

    A LoRA wrapper's ``base_layer`` is named by the wrapper, its adapter layers (``lora_*``) are left out.
    """
    names = set()
    for name, sub in module.named_modules():
        if next(sub.parameters(recurse=False), None) is None:
            continue
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        names.add(name.removesuffix(".base_layer") if parts[-1] == "base_layer" else name)
    return names
