"""`FP8Config`: float8 training with torchao (field names and defaults of the reference system)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from automodel_mesh.config_dict import ConfigDict

__all__ = ["FP8_RECIPES", "FP8Config", "build_fp8_config", "create_fp8_config_from_dict"]

FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# to_dict() key -> field, as the reference system names them.
_RENAMED = {"fp8_recipe_name": "recipe_name", "fp8_filter_fqns": "filter_fqns", "fp8_emulate": "emulate"}
_FIELD_KEYS = {field_name: key for key, field_name in _RENAMED.items()}


@dataclass(kw_only=True)
class FP8Config(ConfigDict):
    """Float8 training of linear layers through ``torchao.float8.convert_to_float8_training``.

    `apply_fp8_to_model` converts every ``nn.Linear`` except: the output head (unless
    ``convert_output_head``), LoRA adapter layers, layers whose FQN contains one of ``filter_fqns``, and
    layers whose dims do not divide by 16 (left in high precision with one warning listing them).
    """

    enabled: bool = False
    """Whether `apply_fp8_to_model` converts anything; False makes it a no-op."""

    recipe_name: str | None = None
    """``None`` or ``"tensorwise"`` (dynamic per-tensor scales), ``"rowwise"``, ``"rowwise_with_gw_hp"``
    (rowwise, with the weight gradient in high precision)."""

    enable_fsdp_float8_all_gather: bool = False
    """Under FSDP2, all-gather weights in float8 (half the traffic of bf16). Tensorwise only."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With FP8 all-gather, compute all weights' scales in one all-reduce after each optimizer step;
    the trainer calls `precompute_fp8_scales_for_fsdp(model)` then. Needs FP8 all-gather."""

    force_recompute_fp8_weight_in_bwd: bool = False
    """Kept for configs written for the reference system: torchao deprecated it and no longer reads it
    (pytorch/ao#2251), so ``True`` acts on nothing and warns."""

    filter_fqns: list[str] = field(default_factory=list)
    """FQN substrings of linears to keep in high precision (e.g. ``["lm_head", "router"]``)."""

    emulate: bool = False
    """Emulate float8 matmuls in high precision: for CPU hosts and GPUs older than SM 8.9."""

    convert_output_head: bool = False
    """Also convert the model's output head (``get_output_embeddings()`` / ``lm_head``); off by default
    because a float8 vocabulary projection costs accuracy for little speed."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"FP8Config.{f.name} must be a bool, got {getattr(self, f.name)!r}")
        if self.recipe_name is not None and self.recipe_name not in FP8_RECIPES:
            raise ValueError(
                f"FP8Config.recipe_name={self.recipe_name!r} is unknown; use None or one of "
                f"{list(FP8_RECIPES)}"
            )
        if isinstance(self.filter_fqns, str):
            self.filter_fqns = [self.filter_fqns]
        if self.filter_fqns is not None and not isinstance(self.filter_fqns, list | tuple):
            raise ValueError(
                f"FP8Config.filter_fqns must be a list of FQN substrings, got {self.filter_fqns!r}"
            )
        self.filter_fqns = list(self.filter_fqns or [])
        bad = [f for f in self.filter_fqns if not isinstance(f, str) or not f]
        if bad:
            raise ValueError(f"FP8Config.filter_fqns must hold non-empty strings, got {bad!r}")
        if self.enable_fsdp_float8_all_gather and self.recipe_name not in (None, "tensorwise"):
            raise ValueError(
                f"FP8Config.enable_fsdp_float8_all_gather=True works with the tensorwise recipe only, got "
                f"recipe_name={self.recipe_name!r}; set recipe_name='tensorwise' or disable the FP8 "
                "all-gather"
            )
        if self.force_recompute_fp8_weight_in_bwd:
            warnings.warn(
                "FP8Config.force_recompute_fp8_weight_in_bwd is ignored: torchao deprecated it and no longer "
                "reads it (pytorch/ao#2251); drop it",
                stacklevel=3,
            )
        if not self.enabled:  # every other setting then acts on nothing
            others = [
                f.name for f in fields(self) if f.name not in ("enabled", "force_recompute_fp8_weight_in_bwd")
            ]
            self.warn_unused(self.changed_fields(others), "enabled is False (set enabled=True)")
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            warnings.warn(
                "FP8Config.precompute_float8_dynamic_scale_for_fsdp is ignored: it needs "
                "enable_fsdp_float8_all_gather=True",
                stacklevel=3,
            )

    @property
    def precompute_scales(self) -> bool:
        """Whether the post-optimizer scale precomputation applies (tensorwise + FP8 all-gather)."""
        return (
            self.enabled
            and self.precompute_float8_dynamic_scale_for_fsdp
            and self.enable_fsdp_float8_all_gather
            and self.recipe_name in (None, "tensorwise")
        )

    # The reference system's dict: ``recipe_name``, ``filter_fqns``, ``emulate`` are ``fp8_*`` there;
    # `from_dict` takes both spellings.
    _dict_aliases: ClassVar[Mapping[str, str]] = _RENAMED

    def to_dict(self) -> dict[str, Any]:
        """The reference system's dict (``fp8_*`` keys for the renamed fields).

        ``convert_output_head``, which the reference system does not have, appears only when True, so a
        config the reference can express gives exactly its seven keys (and `from_dict` round-trips both).
        """
        out = super().to_dict()
        if not self.convert_output_head:
            del out["convert_output_head"]
        return out

    def _dict_key(self, name: str) -> str:
        """``fp8_recipe_name``, ``fp8_filter_fqns``, ``fp8_emulate`` for the renamed fields."""
        return _FIELD_KEYS.get(name, name)

    def _dict_value(self, name: str, value: Any) -> Any:
        """Lists copied."""
        return list(value) if isinstance(value, list) else value


def build_fp8_config(config: FP8Config | Mapping[str, Any] | None) -> FP8Config:
    """Build an `FP8Config` from ``None``, a config or a dict.

    ``None`` gives ``FP8Config(enabled=False)`` (as in the reference system), an `FP8Config` itself, a
    dict `FP8Config.from_dict`.

    Raises:
        ValueError: A dict with an unknown key (the reference system ignores unknown keys).
    """
    if config is None:
        return FP8Config(enabled=False)
    if isinstance(config, FP8Config):
        return config
    return FP8Config.from_dict(config)


def create_fp8_config_from_dict(config_dict: Mapping[str, Any]) -> FP8Config:
    """The reference system's name for `FP8Config.from_dict` (missing keys take the defaults).

    Raises:
        ValueError: An unknown key (the reference system ignores unknown keys).
    """
    return FP8Config.from_dict(config_dict)
