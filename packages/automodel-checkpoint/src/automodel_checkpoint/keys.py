"""Map model parameter names to checkpoint keys, and find what a model expects from a checkpoint.

Wrappers change parameter names without changing the weights: activation checkpointing inserts
``_checkpoint_wrapped_module.``, ``torch.compile`` ``_orig_mod.``, DDP a leading ``module.``, peft a
leading ``base_model.model.`` and a ``.base_layer`` segment inside each adapted layer. `KeyRules`
holds those rewrites as data (`DEFAULT_KEY_RULES`); extend them by building another `KeyRules`.
Adapter parameters (inside the sub-modules of ``automodel_modules.ADAPTER_SEGMENTS``, the one
adapter rule every package uses) are not part of a base checkpoint.

Checkpoint-side renames (legacy key names, a saved base model without its head prefix) are regex
substitutions applied to the checkpoint's keys, like transformers' ``key_mapping`` argument.

Everything here reads the model only; nothing is mutated and there are no collectives.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from automodel_modules import WRAPPER_SEGMENTS, is_adapter_fqn

__all__ = [
    "DEFAULT_KEY_RULES",
    "KeyRules",
    "TensorSlot",
    "apply_key_mapping",
    "checkpoint_key",
    "collect_tensor_slots",
]


@dataclass(frozen=True)
class KeyRules:
    """How model FQNs become checkpoint keys.

    Attributes:
        drop_segments: Dotted name components removed wherever they appear.
        drop_prefixes: Leading component sequences removed (repeatedly, in any order).
    """

    drop_segments: frozenset[str] = field(
        default_factory=lambda: frozenset({*WRAPPER_SEGMENTS, "base_layer"})
    )
    drop_prefixes: tuple[tuple[str, ...], ...] = (("module",), ("base_model", "model"))


DEFAULT_KEY_RULES = KeyRules()
"""Checkpoint-wrapper, compile, FSDP1, DDP and peft name rewrites."""


def checkpoint_key(fqn: str, rules: KeyRules = DEFAULT_KEY_RULES) -> str:
    """The checkpoint key of a model FQN: wrapper segments and prefixes removed.

    An adapter's own parameters keep peft's ``base_layer`` segments: peft nests one ``ParamWrapper`` per
    adapted parameter of a module (LoRA on fused MoE experts), and ``experts.base_layer.lora_A`` (the inner
    wrapper's factor) is another tensor than ``experts.lora_A``.

    >>> checkpoint_key("base_model.model.model.layers.0._checkpoint_wrapped_module.mlp.up.base_layer.weight")
    'model.layers.0.mlp.up.weight'
    """
    drop = rules.drop_segments - {"base_layer"} if is_adapter_fqn(fqn) else rules.drop_segments
    parts = [part for part in fqn.split(".") if part not in drop]
    changed = True
    while changed:
        changed = False
        for prefix in rules.drop_prefixes:
            if len(parts) > len(prefix) and tuple(parts[: len(prefix)]) == prefix:
                parts = parts[len(prefix) :]
                changed = True
    return ".".join(parts)


def apply_key_mapping(keys: Iterable[str], key_mapping: Mapping[str, str] | None) -> dict[str, str]:
    """Rename checkpoint keys with regex substitutions; returns new key -> original key.

    Each ``pattern -> replacement`` pair is applied with ``re.sub`` in order.

    Raises:
        ValueError: Two checkpoint keys map to the same new key (both are named).
    """
    compiled = [(re.compile(p), r) for p, r in (key_mapping or {}).items()]
    out: dict[str, str] = {}
    for key in keys:
        new = key
        for pattern, replacement in compiled:
            new = pattern.sub(replacement, new)
        if new in out:
            raise ValueError(
                f"key_mapping maps both checkpoint keys {out[new]!r} and {key!r} to {new!r}; fix the mapping"
            )
        out[new] = key
    return out


@dataclass
class TensorSlot:
    """One tensor of a model (a parameter or persistent buffer) and every name it is reachable by.

    Tied weights are one slot with several names (e.g. input embedding and LM head).

    Attributes:
        keys: Checkpoint keys of the slot, in module order (the first is the canonical one).
        fqns: The model FQNs, aligned with ``keys``.
        tensor: The tensor itself (a DTensor when sharded).
        is_param: Parameter (True) or persistent buffer (False).
        owners: ``(module, attribute name)`` pairs holding it.
    """

    keys: list[str]
    fqns: list[str]
    tensor: torch.Tensor
    is_param: bool
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def collect_tensor_slots(
    model: nn.Module, rules: KeyRules = DEFAULT_KEY_RULES, *, include_adapters: bool = False
) -> list[TensorSlot]:
    """Every parameter and persistent buffer of ``model`` as slots keyed by checkpoint key.

    Args:
        model: The model (possibly wrapped, sharded, on meta).
        rules: Name rewrites.
        include_adapters: Keep LoRA adapter parameters (skipped by default: not in base checkpoints).

    Returns:
        Slots in module order; a tensor reachable under several names is one slot.

    Raises:
        ValueError: Two different tensors map to the same checkpoint key (both FQNs named).
    """
    by_id: dict[int, TensorSlot] = {}
    key_owner: dict[str, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        tensors: list[tuple[str, torch.Tensor | None, bool]] = [
            (n, p, True) for n, p in module._parameters.items()
        ]
        tensors += [
            (n, b, False) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]
        for name, tensor, is_param in tensors:
            if tensor is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            if not include_adapters and is_adapter_fqn(fqn):
                continue
            key = checkpoint_key(fqn, rules)
            slot = by_id.get(id(tensor))
            if slot is None:
                slot = by_id[id(tensor)] = TensorSlot([], [], tensor, is_param)
            if key in key_owner and key_owner[key] != fqn and key not in slot.keys:
                raise ValueError(
                    f"model parameters {key_owner[key]!r} and {fqn!r} both map to checkpoint key {key!r}; "
                    "pass KeyRules that keep them apart"
                )
            key_owner.setdefault(key, fqn)
            if (module, name) not in [(m, n) for m, n in slot.owners]:
                slot.owners.append((module, name))
            if key not in slot.keys:
                slot.keys.append(key)
                slot.fqns.append(fqn)
    return list(by_id.values())
