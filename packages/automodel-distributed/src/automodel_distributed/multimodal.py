"""The parts of a multimodal model (vision tower, audio tower, projector, language model) and freezing them.

Parts are read from the model's own structure, never from its family: a composite transformers config
lists its sub-configs (``sub_configs``: ``vision_config``, ``text_config``, ``audio_config``, ...), and
the tower built from a sub-config keeps that very config object as its ``config``. So the outermost
sub-module whose ``config`` *is* ``model.config.vision_config`` is the vision tower, the one holding the
``text_config`` the language model (its output head belongs to it too), and every other child of the
base model (``multi_modal_projector``, ``connector``) is a projector. A model without sub-configs is a
language model only.

`FreezeConfig` is the reference system's ``freeze_config`` (same keys, same defaults);
`apply_freeze_config` sets ``requires_grad=False`` on the chosen parts before sharding, so frozen
parameters never get gradients, gradient buffers or optimizer state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from automodel_mesh.config_dict import ConfigDict
from automodel_modules import embedding_module

__all__ = [
    "LANGUAGE",
    "PROJECTOR",
    "FreezeConfig",
    "ModelParts",
    "apply_freeze_config",
    "model_parts",
]

logger = logging.getLogger(__name__)

LANGUAGE = "language"
"""Role of the language model (the module holding ``text_config``, with the output head)."""
PROJECTOR = "projector"
"""Role of the base model's other children (the projectors between towers and language model)."""

_ROLE_OF_SUB_CONFIG = {"text_config": LANGUAGE}
"""Sub-config name -> role where the name minus ``_config`` is not the role."""


@dataclass(frozen=True)
class ModelParts:
    """The parts of a model by role.

    Attributes:
        parts: Role (``vision``, ``audio``, ``video``, ..., `LANGUAGE`, `PROJECTOR`) -> ``(fqn, module)``
            pairs, in module order. A role a model lacks is absent.
    """

    parts: Mapping[str, tuple[tuple[str, nn.Module], ...]]

    def modules(self, role: str) -> tuple[nn.Module, ...]:
        """The modules of ``role`` (empty when the model has none)."""
        return tuple(module for _, module in self.parts.get(role, ()))

    def role_of(self, fqn: str) -> str | None:
        """The role of the part that contains the module or parameter ``fqn`` (``None``: none)."""
        for role, found in self.parts.items():
            for prefix, _ in found:
                if fqn == prefix or fqn.startswith(prefix + "."):
                    return role
        return None

    @property
    def is_multimodal(self) -> bool:
        """Whether the model has a part other than the language model."""
        return any(role != LANGUAGE for role in self.parts)


def model_parts(model: nn.Module) -> ModelParts:
    """The parts of ``model`` found from its config's sub-configs (see the module docstring).

    Works on meta models and on models wrapped by peft, activation checkpointing or FSDP (the FQNs are
    those of ``model.named_modules()``). Reads only.
    """
    config = getattr(model, "config", None)
    sub_names = tuple(getattr(type(config), "sub_configs", None) or {}) if config is not None else ()
    subs = {name: getattr(config, name, None) for name in sub_names}
    subs = {name: sub for name, sub in subs.items() if sub is not None}
    found: dict[str, list[tuple[str, nn.Module]]] = {}
    claimed: list[str] = []
    for fqn, module in model.named_modules():
        if not fqn or any(fqn.startswith(prefix + ".") for prefix in claimed):
            continue
        own = getattr(module, "config", None)
        for name, sub in subs.items():
            if own is sub:
                role = _ROLE_OF_SUB_CONFIG.get(name, name.removesuffix("_config"))
                found.setdefault(role, []).append((fqn, module))
                claimed.append(fqn)
                break
    if found:
        _add_head_and_projectors(model, found, claimed)
    return ModelParts({role: tuple(items) for role, items in found.items()})


def _add_head_and_projectors(
    model: nn.Module, found: dict[str, list[tuple[str, nn.Module]]], claimed: list[str]
) -> None:
    head = embedding_module(model, "output")
    names = {id(module): fqn for fqn, module in model.named_modules()}
    if head is not None and id(head) in names and LANGUAGE in found:
        found[LANGUAGE].append((names[id(head)], head))
        claimed.append(names[id(head)])
    # The projectors: children of a module that holds a part, which hold no part themselves.
    parents = {fqn.rpartition(".")[0] for fqn in claimed}
    for parent in sorted(parents):
        holder = model.get_submodule(parent) if parent else model
        for name, child in holder.named_children():
            fqn = f"{parent}.{name}" if parent else name
            if fqn in claimed or any(c.startswith(fqn + ".") for c in claimed):
                continue
            if any(True for _ in child.parameters()):
                found.setdefault(PROJECTOR, []).append((fqn, child))


@dataclass(kw_only=True)
class FreezeConfig(ConfigDict):
    """Which parts to freeze before sharding (the reference's ``freeze_config``, same keys and defaults)."""

    freeze_embeddings: bool = True
    """Freeze every ``nn.Embedding`` (token, position and patch-position embeddings of every part)."""
    freeze_vision_tower: bool = True
    """Freeze the vision tower (the module built from ``vision_config``)."""
    freeze_audio_tower: bool = False
    """Freeze the audio tower (the module built from ``audio_config``)."""
    freeze_language_model: bool = False
    """Freeze the language model (the module built from ``text_config``) and its output head."""
    freeze_video_embedder: bool = False
    """Freeze the video tower (the module built from ``video_config``)."""

    def __post_init__(self) -> None:
        for name in (
            "freeze_embeddings",
            "freeze_vision_tower",
            "freeze_audio_tower",
            "freeze_language_model",
            "freeze_video_embedder",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FreezeConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def coerce(cls, value: Any) -> FreezeConfig:
        """A `FreezeConfig` from itself or from the reference's dict (unknown keys are refused).

        Raises:
            ValueError: Not a `FreezeConfig` or a mapping, or a key that is no field.
        """
        if isinstance(value, FreezeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"freeze_config must be a FreezeConfig or a dict, got {type(value).__name__}")
        return cls.from_dict(dict(value))


_ROLES_OF_FIELDS = {
    "freeze_vision_tower": "vision",
    "freeze_audio_tower": "audio",
    "freeze_language_model": LANGUAGE,
    "freeze_video_embedder": "video",
}


def apply_freeze_config(model: nn.Module, config: FreezeConfig | Mapping[str, Any]) -> dict[str, int]:
    """Set ``requires_grad=False`` on the parts ``config`` freezes; returns role -> parameters frozen.

    A part the config freezes but the model lacks is reported with a warning (nothing to freeze).
    Preconditions: before sharding (any device, meta included). Mutates ``requires_grad`` only.

    Raises:
        ValueError: ``config`` is not a `FreezeConfig` or its dict.
    """
    config = FreezeConfig.coerce(config)
    parts = model_parts(model)
    frozen: dict[str, int] = {}
    for name, role in _ROLES_OF_FIELDS.items():
        if not getattr(config, name):
            continue
        modules = parts.modules(role)
        if not modules:
            if name != "freeze_vision_tower" or parts.is_multimodal:
                logger.warning("freeze_config.%s: %s has no %s part", name, type(model).__name__, role)
            continue
        for module in modules:
            for param in module.parameters():
                if param.requires_grad:
                    param.requires_grad_(False)
                    frozen[role] = frozen.get(role, 0) + param.numel()
    if config.freeze_embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding) and module.weight.requires_grad:
                module.weight.requires_grad_(False)
                frozen["embeddings"] = frozen.get("embeddings", 0) + module.weight.numel()
    logger.info("freeze_config froze %s parameters of %s", frozen, type(model).__name__)
    return frozen
