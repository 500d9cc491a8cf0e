"""Which linear layers a `PeftConfig` adapts: its pattern rules resolved on a model (pure).

The pattern forms are those of `automodel_peft.patterns`. Precedence: ``match_all_linear`` >
``target_modules`` > everything except ``exclude_modules``. The first and last leave the model's output
head out (a vocabulary-sized adapter is rarely wanted); name it in ``target_modules`` to adapt it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from automodel_modules import is_conv1d, maps_like_linear, output_head_fqns
from automodel_peft._names import clean_fqn, is_adapter_name
from automodel_peft.config import PeftConfig
from automodel_peft.patterns import patterns_to_regex

__all__ = [
    "ModuleMatcher",
    "is_causal_lm",
    "is_linear_layer",
    "output_head_names",
    "resolve_target_modules",
    "unmatched_patterns",
]


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
    left_out: frozenset[str] = frozenset()
    """Names ``match_all_linear`` and exclude-mode also leave out: routers, and linears peft refuses."""

    def match(self, module: nn.Module, name: str) -> bool:
        """Whether the module called ``name`` gets an adapter (linears only; adapters never)."""
        fqn = clean_fqn(name)
        if not is_linear_layer(module) or is_adapter_name(fqn) or fqn.endswith(".base_layer"):
            return False
        cfg = self.config
        if cfg.match_all_linear:
            return fqn not in self.output_heads and fqn not in self.left_out and _computes_linear(module)
        targets = _compile(cfg.target_modules)
        if targets is not None:
            return targets.fullmatch(fqn) is not None
        excludes = _compile(cfg.exclude_modules)
        kept = excludes is None or excludes.fullmatch(fqn) is None
        return fqn not in self.output_heads and fqn not in self.left_out and kept and _computes_linear(module)


def is_linear_layer(module: nn.Module) -> bool:
    """Whether LoRA can adapt ``module`` as a linear layer: an `nn.Linear` or transformers' ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _computes_linear(module: nn.Module) -> bool:
    """Whether the module maps ``(..., in)`` to ``(..., out)``, so a low-rank delta of that shape adds.

    `nn.Linear` and ``Conv1D`` do; a subclass with its own forward must pass `maps_like_linear` (a
    block-diagonal grouped projection, which only borrows the weight, does not). The broad selectors
    leave such modules out; naming one in ``target_modules`` still adapts it.
    """
    if type(module).forward is nn.Linear.forward or is_conv1d(module):
        return True
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    out_features, in_features = weight.shape
    return maps_like_linear(module, int(in_features), int(out_features))


def _router_classes(model: nn.Module) -> tuple[type, ...]:
    """The MoE router classes transformers declares (``_can_record_outputs["router_logits"]``).

    A router is a linear that picks experts: an adapter on it changes which experts train, and routers
    that return their logits with the scores (a tuple) cannot be wrapped at all.
    """
    found: set[type] = set()
    for module in model.modules():
        recorded = getattr(module, "_can_record_outputs", None) or {}
        for key, value in dict(recorded).items():
            if "router" not in str(key):
                continue
            target = getattr(value, "target_class", value)
            if isinstance(target, type):
                found.add(target)
    return tuple(found)


def _refused_by_peft(model: nn.Module, fqn: str) -> bool:
    """Whether peft refuses an adapter on this linear for this model (its own per-architecture rule)."""
    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:  # a peft without the rule
        return False
    import peft

    try:
        check(peft.LoraConfig(target_modules=[fqn]), model, fqn.rpartition(".")[2])
    except ValueError:
        return True
    return False


def resolve_target_modules(model: nn.Module, config: PeftConfig) -> list[str]:
    """The full names of the linears `apply_lora` adapts, in module order. Pure.

    Linears already wrapped by a LoRA layer are skipped (their ``base_layer`` is not adapted twice).
    ``match_all_linear`` and exclude-mode also leave out the output head, the MoE routers transformers
    declares, and the linears peft refuses for the model (Mamba's ``out_proj``); name them in
    ``target_modules`` to get the head, or peft's own error for the others.
    """
    routers = _router_classes(model)
    left_out = frozenset(
        clean_fqn(name)
        for name, module in model.named_modules()
        if is_linear_layer(module)
        and (isinstance(module, routers) or _refused_by_peft(model, clean_fqn(name)))
    )
    matcher = ModuleMatcher(config, frozenset(output_head_names(model)), left_out)
    return [clean_fqn(name) for name, module in model.named_modules() if matcher.match(module, name)]


def unmatched_patterns(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The entries of ``patterns`` (``target_modules`` / ``exclude_modules`` forms) that name no linear layer.

    Such an entry acts on nothing: a misspelt name, or a layer the model does not have (a fused expert
    weight is a parameter, not a linear: see ``target_parameters``). Pure.
    """
    linears = [
        clean_fqn(name)
        for name, module in model.named_modules()
        if is_linear_layer(module) and not is_adapter_name(clean_fqn(name))
    ]
    return [p for p in patterns if not any(re.fullmatch(patterns_to_regex([p]), fqn) for fqn in linears)]
