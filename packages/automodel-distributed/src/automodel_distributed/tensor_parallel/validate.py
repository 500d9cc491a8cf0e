"""Checks that run before any collective, so a model that cannot be sharded fails alike on every rank."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from automodel_distributed.tensor_parallel._fqn import match_modules
from automodel_distributed.tensor_parallel.linear_styles import linear_features
from automodel_distributed.tensor_parallel.styles import ReplicateParallel
from automodel_modules import find_hf_model

__all__ = ["PARAM_STYLES", "is_local_colwise", "modules_by_style", "validate_tensor_parallel"]

_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")
# Styles that turn a module's parameters into DTensors; a module must get at most one of them.
PARAM_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel, ReplicateParallel)


def _configs(hf_model: nn.Module) -> Iterator[tuple[str, Any]]:
    config = getattr(hf_model, "config", None)
    if config is None:
        return
    yield type(config).__name__, config
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            text = get_text_config(decoder=True)
        except (TypeError, ValueError):
            text = get_text_config()
        if text is not None and text is not config:
            yield f"{type(config).__name__} text config {type(text).__name__}", text


def _int_field(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _config_hint(hf_model: nn.Module, value: int) -> str:
    names: list[str] = []
    for _, config in _configs(hf_model):
        to_dict = getattr(config, "to_dict", None)
        items = to_dict().items() if callable(to_dict) else vars(config).items()
        names += [k for k, v in items if v == value and isinstance(v, int) and not isinstance(v, bool)]
    return f" (= config {', '.join(dict.fromkeys(names))})" if names else ""


def modules_by_style(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, list[ParallelStyle]]:
    """Concrete module FQN -> the styles the plan applies to it, in plan order."""
    out: dict[str, list[ParallelStyle]] = {}
    for key, style in plan.items():
        for fqn, _ in match_modules(model, key):
            out.setdefault(fqn, []).append(style)
    return out


def _is_last_dim_shard(layouts: tuple[Any, ...]) -> bool:
    return len(layouts) == 1 and isinstance(layouts[0], Shard) and layouts[0].dim == -1


def is_local_colwise(style: ParallelStyle) -> bool:
    """A column-parallel style that hands on this rank's slice of the last dim as a plain tensor."""
    return (
        isinstance(style, ColwiseParallel)
        and style.use_local_output
        and _is_last_dim_shard(style.output_layouts)
    )


def _splits_heads(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> bool:
    """Whether the plan hands on a column-parallel slice of a projection inside an attention module."""
    for fqn, styles in modules_by_style(model, plan).items():
        if not any(is_local_colwise(s) for s in styles):
            continue
        parts = fqn.split(".")
        for depth in range(len(parts)):
            owner = type(model.get_submodule(".".join(parts[:depth]))).__name__.lower()
            if "attention" in owner or "attn" in owner:
                return True
    return False


def _plan_problems(model: nn.Module, plan: Mapping[str, ParallelStyle], tp_size: int) -> list[str]:
    _, hf_model = find_hf_model(model)
    problems: list[str] = []
    for fqn, styles in modules_by_style(model, plan).items():
        module = model.get_submodule(fqn)
        name = fqn or "<root>"
        param_styles = [s for s in styles if isinstance(s, PARAM_STYLES)]
        if len(param_styles) > 1:
            problems.append(f"{name} gets two parameter-sharding styles {param_styles}; give it one")
        for style in styles:
            if not isinstance(style, ColwiseParallel | RowwiseParallel):
                continue
            kind = type(style).__name__
            features = linear_features(module)
            if features is None and not isinstance(module, nn.Embedding):
                problems.append(
                    f"{name} is a {type(module).__name__}, but {kind} applies to nn.Linear, transformers' "
                    "Conv1D and nn.Embedding only"
                )
                continue
            # A plain tensor handed between modules is read back by `DTensor.from_local`, which assumes
            # equal slices; sharded DTensors (e.g. vocab-sharded logits) may be uneven.
            if is_local_colwise(style):
                size = features[1] if features is not None else int(getattr(module, "embedding_dim", 0))
                field = "out_features" if features is not None else "embedding_dim"
                if size % tp_size:
                    problems.append(
                        f"{name}: {field}={size}{_config_hint(hf_model, size)} is not divisible by "
                        f"tp_size={tp_size} (its column-parallel output is handed on as an equal local slice)"
                    )
            if (
                isinstance(style, RowwiseParallel)
                and features is not None
                and _is_last_dim_shard(style.input_layouts)
                and features[0] % tp_size
            ):
                size = features[0]
                problems.append(
                    f"{name}: in_features={size}{_config_hint(hf_model, size)} is not divisible by "
                    f"tp_size={tp_size} (its row-parallel input arrives as an equal local slice)"
                )
    return problems


def validate_tensor_parallel(
    model: nn.Module, tp_size: int, *, plan: Mapping[str, ParallelStyle] | None = None
) -> None:
    """Check that a model can be tensor-parallel over ``tp_size`` ranks. Pure: no collective, no mutation.

    Heads: ``num_attention_heads`` and ``num_key_value_heads`` of the model's config and of its text config
    (``config.get_text_config()``, for multimodal models) divide by ``tp_size``, since every rank must
    hold whole heads. Without ``plan`` this is always checked; with one, only when the plan splits heads:
    it hands on a column-parallel slice from a projection inside an attention module (a module whose class
    name says attention, ``Attention`` / ``Attn``). A plan that gathers fused projections
    (``colwise_rep``) runs every head on every rank and needs no such division (multi-query attention).

    With ``plan`` (keys relative to ``model``): every column/row-parallel target is an ``nn.Linear``,
    transformers' ``Conv1D`` or an ``nn.Embedding``; a module gets at most one parameter-sharding style;
    and where a shard is handed on as a plain local tensor, the sharded dim divides by ``tp_size`` (a
    column-parallel output feeding a row-parallel input, i.e. the attention and MLP widths). Dims that stay
    inside a DTensor need not divide: DTensor shards unevenly, so e.g. a vocabulary of 129 over 2 ranks
    works for the vocab-parallel embedding and the vocab-sharded logits. The hidden size is never sharded
    by the built-in plans.

    Args:
        model: The model (possibly inside a peft wrapper).
        tp_size: The tensor-parallel degree.
        plan: A resolved plan, to check module shapes as well.

    Raises:
        ValueError: Listing every problem, e.g. ``"num_key_value_heads=2 is not divisible by tp_size=4"``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if tp_size == 1:
        return
    _, hf_model = find_hf_model(model)
    problems: list[str] = []
    heads: dict[str, int] = {}
    for where, config in _configs(hf_model) if plan is None or _splits_heads(model, plan) else ():
        for field in _HEAD_FIELDS:
            value = _int_field(config, field)
            if value is None:
                continue
            heads.setdefault(field, value)
            if value % tp_size:
                problems.append(f"{field}={value} is not divisible by tp_size={tp_size} ({where})")
    if problems:
        sizes = ", ".join(f"{k}={v}" for k, v in heads.items())
        problems.append(
            f"every tensor-parallel rank must hold whole attention heads; pick a tp_size dividing {sizes}"
        )
    if plan is not None:
        problems += _plan_problems(model, plan, tp_size)
    if problems:
        raise ValueError(
            f"cannot shard {type(hf_model).__name__} over tp_size={tp_size}: " + "; ".join(problems)
        )
