"""Which linear layers a `PeftConfig` adapts: pattern rules and their resolution on a model (pure).

A pattern without ``*`` matches a module whose name is it or ends with ``.`` + it (a leaf name such as
``"q_proj"`` or a dotted suffix such as ``"self_attn.q_proj"``); a pattern with ``*`` (any characters,
dots included) must match the whole dotted name (``"*.layers.*.mlp.*_proj"``). Precedence:
``match_all_linear`` > ``target_modules`` > everything except ``exclude_modules``. The first and last
leave the model's output head out (a vocabulary-sized adapter is rarely wanted); name it in
``target_modules`` to adapt it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from automodel_mesh.modules import output_head_fqns
from automodel_peft._names import clean_fqn, is_adapter_name
from automodel_peft.config import PeftConfig

__all__ = [
    "ModuleMatcher",
    "is_causal_lm",
    "output_head_names",
    "patterns_to_regex",
    "resolve_target_modules",
]


def _pattern_regex(pattern: str) -> str:
    body = ".*".join(re.escape(part) for part in pattern.split("*"))
    if "*" in pattern:
        return body  # a wildcard pattern covers the whole name
    return rf"(?:.*\.)?{body}"  # a leaf name or dotted suffix matches at any depth


def patterns_to_regex(patterns: Iterable[str]) -> str:
    """One regex that full-matches exactly the names any of ``patterns`` matches (peft's string form)."""
    return "(?:" + "|".join(_pattern_regex(p) for p in patterns) + ")"


def _compile(patterns: Sequence[str]) -> re.Pattern[str] | None:
    return re.compile(patterns_to_regex(patterns)) if patterns else None


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a causal LM: ``config.architectures[0]`` names one, or it has an output head."""
    architectures = getattr(getattr(model, "config", None), "architectures", None) or []
    if architectures and "CausalLM" in str(architectures[0]):
        return True
    return bool(output_head_names(model))


def output_head_names(model: nn.Module) -> set[str]:
    """Names of the output head module(s): ``get_output_embeddings()``, else modules named ``lm_head``."""
    names = output_head_fqns(model)
    return {clean_fqn(name) for name in names}


@dataclass(frozen=True)
class ModuleMatcher:
    """The matching rules of a `PeftConfig`, for one model's output head.

    Attributes:
        config: The config whose selectors apply.
        output_heads: Names left out by ``match_all_linear`` and exclude-mode.
    """

    config: PeftConfig
    output_heads: frozenset[str] = frozenset()

    def match(self, module: nn.Module, name: str) -> bool:
        """Whether the module called ``name`` gets an adapter (linears only; adapters never)."""
        fqn = clean_fqn(name)
        if not isinstance(module, nn.Linear) or is_adapter_name(fqn) or fqn.endswith(".base_layer"):
            return False
        cfg = self.config
        if cfg.match_all_linear:
            return fqn not in self.output_heads
        targets = _compile(cfg.target_modules)
        if targets is not None:
            return targets.fullmatch(fqn) is not None
        excludes = _compile(cfg.exclude_modules)
        return fqn not in self.output_heads and (excludes is None or excludes.fullmatch(fqn) is None)


def resolve_target_modules(model: nn.Module, config: PeftConfig) -> list[str]:
    """The full names of the linears `apply_lora` adapts, in module order. Pure.

    Linears already wrapped by a LoRA layer are skipped (their ``base_layer`` is not adapted twice).
    """
    matcher = ModuleMatcher(config, frozenset(output_head_names(model)))
    return [clean_fqn(name) for name, module in model.named_modules() if matcher.match(module, name)]
