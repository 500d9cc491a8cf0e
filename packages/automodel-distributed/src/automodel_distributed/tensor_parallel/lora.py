"""Tensor parallelism for linears wrapped by peft LoRA layers.

A peft ``lora.Linear`` computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. A plan entry that
targets such a wrapper is rewritten into entries for its parts, so that the sum is sharded exactly like
the base output:

- column-parallel base (output sharded on the last dim): ``base_layer`` column-parallel, ``lora_A``
  replicated (its input brought to ``Replicate``), ``lora_B`` column-parallel from that replicated input to
  the base's output layout. ``lora_A``'s gradient is the sum over the ranks' ``lora_B`` slices, which
  DTensor computes from the ``Partial`` gradient ``lora_B`` hands back.
- row-parallel base (input sharded on the last dim): ``base_layer`` row-parallel, ``lora_A`` row-parallel
  (input dim sharded, its partial output reduced to the base's output layout), ``lora_B`` replicated
  (under sequence parallelism applied to this rank's tokens, its weight gradient summed over the ranks).

The wrapper is recognised by its structure (a ``base_layer`` and ``lora_A`` / ``lora_B`` ``ModuleDict``s),
not by model family, and every adapter in the dicts is covered.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from automodel_distributed.tensor_parallel._fqn import match_modules
from automodel_distributed.tensor_parallel.linear_styles import ColwiseParallel as LinearColwise
from automodel_distributed.tensor_parallel.linear_styles import RowwiseParallel as LinearRowwise
from automodel_distributed.tensor_parallel.styles import ReplicatedWithGradAllReduce, ReplicateParallel
from automodel_modules import join_fqn

__all__ = [
    "ColwiseParallelLora",
    "RowwiseParallelLora",
    "SequenceParallelLora",
    "expand_lora_plan",
    "is_lora_linear",
    "translate_to_lora",
]


def is_lora_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a LoRA-wrapped linear (peft's ``lora.Linear`` or anything shaped like it)."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def _is_lora_other(module: nn.Module) -> bool:
    """A LoRA wrapper we cannot shard (e.g. peft's ``lora.Embedding``, whose adapters are raw parameters)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and any(
        isinstance(getattr(module, name, None), nn.ParameterDict) and len(getattr(module, name)) > 0
        for name in ("lora_embedding_A", "lora_embedding_B")
    )


def _check_wrapper(fqn: str, module: nn.Module, style: ParallelStyle, replicated_input: bool) -> None:
    if not isinstance(style, ColwiseParallel | RowwiseParallel):
        raise ValueError(
            f"{fqn} is LoRA-wrapped; only column- or row-parallel styles can be split over base_layer, "
            f"lora_A and lora_B, got {type(style).__name__}"
        )
    variants = getattr(module, "lora_variant", None) or {}
    magnitudes = getattr(module, "lora_magnitude_vector", None) or {}
    if len(variants) or len(magnitudes):
        raise ValueError(
            f"{fqn} uses a LoRA variant (e.g. DoRA: {sorted(set(variants) | set(magnitudes))}), which cannot "
            "be tensor-parallel sharded here; use plain LoRA or leave this module out of the TP plan"
        )
    dropouts = getattr(module, "lora_dropout", None) or {}
    for adapter, dropout in dropouts.items():
        if replicated_input and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise ValueError(
                f"{fqn}: lora_dropout={dropout.p} on adapter {adapter!r} would draw a different mask on each "
                "tensor-parallel rank for the same replicated input, which makes the LoRA gradients wrong; "
                "use lora_dropout=0 for column-parallel targets under tensor parallelism"
            )


def _lora_entries(fqn: str, module: nn.Module, style: ParallelStyle) -> dict[str, ParallelStyle]:
    entries: dict[str, ParallelStyle] = {join_fqn(fqn, "base_layer"): style}
    lora_a = module.get_submodule("lora_A")
    assert isinstance(lora_a, nn.ModuleDict)
    adapters = list(lora_a.keys())
    if isinstance(style, ColwiseParallel):
        in_layout, out_layout = style.input_layouts[0], style.output_layouts[0]
        for adapter in adapters:
            entries[join_fqn(fqn, f"lora_A.{adapter}")] = ReplicateParallel(
                input_layouts=in_layout, desired_input_layouts=Replicate(), use_local_output=False
            )
            entries[join_fqn(fqn, f"lora_B.{adapter}")] = LinearColwise(
                input_layouts=Replicate(), output_layouts=out_layout, use_local_output=style.use_local_output
            )
    else:
        assert isinstance(style, RowwiseParallel)
        in_layout, out_layout = style.input_layouts[0], style.output_layouts[0]
        # Under sequence parallelism (output Shard(seq)) lora_B acts token by token on this rank's slice:
        # it runs on the local tensor, its replicated weight's gradient summed over the ranks
        # (`ReplicatedWithGradAllReduce`). As a Shard(seq) DTensor, F.linear would flatten a sharded
        # dim, which torch before 2.15 cannot propagate.
        tokenwise = isinstance(out_layout, Shard) and style.use_local_output
        for adapter in adapters:
            entries[join_fqn(fqn, f"lora_A.{adapter}")] = LinearRowwise(
                input_layouts=in_layout, output_layouts=out_layout, use_local_output=tokenwise
            )
            entries[join_fqn(fqn, f"lora_B.{adapter}")] = (
                ReplicatedWithGradAllReduce()
                if tokenwise
                else ReplicateParallel(
                    input_layouts=out_layout,
                    desired_input_layouts=None,
                    use_local_output=style.use_local_output,
                )
            )
    return entries


def _input_is_replicated(style: ParallelStyle) -> bool:
    if isinstance(style, ColwiseParallel):
        return True  # a column-parallel layer computes on the whole (gathered) input on every rank
    layouts: tuple[object, ...] = getattr(style, "input_layouts", ())
    return len(layouts) > 0 and isinstance(layouts[0], Replicate)


def expand_lora_plan(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Rewrite entries that target LoRA-wrapped linears into entries for their parts. Pure.

    An entry whose pattern matches no LoRA wrapper is kept as it is. An entry that matches one is replaced,
    in place, by concrete entries: the LoRA parts of each wrapper (see the module docstring) and the other
    matches under their own names.

    Args:
        model: The model the plan applies to (keys relative to it).
        plan: The resolved plan.

    Returns:
        The rewritten plan.

    Raises:
        ValueError: A LoRA wrapper that cannot be sharded: a style other than column/row-parallel, a LoRA
            variant such as DoRA, a LoRA embedding, or ``lora_dropout > 0`` on a replicated input.
    """
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        matches = match_modules(model, key)
        for fqn, module in matches:
            if _is_lora_other(module):
                raise ValueError(
                    f"{fqn} is a LoRA-wrapped {type(module.base_layer).__name__}, which cannot be tensor-"
                    "parallel sharded; leave it out of the LoRA target_modules or out of the TP plan"
                )
        if not any(is_lora_linear(module) for _, module in matches):
            out[key] = style
            continue
        for fqn, module in matches:
            if is_lora_linear(module):
                _check_wrapper(fqn, module, style, _input_is_replicated(style))
                out.update(_lora_entries(fqn, module, style))
            else:
                out[fqn] = style
    return out


# The reference system's LoRA-aware styles. Here a plain column / row / sequence-parallel style on a
# LoRA-wrapped linear is split over its base layer and adapters by `expand_lora_plan` when
# `apply_tensor_parallel` applies the plan, so the LoRA variants are the plain torch styles.
ColwiseParallelLora = ColwiseParallel
"""torch's ``ColwiseParallel``; LoRA wrappers are handled by `expand_lora_plan`."""
RowwiseParallelLora = RowwiseParallel
"""torch's ``RowwiseParallel``; LoRA wrappers are handled by `expand_lora_plan`."""
SequenceParallelLora = SequenceParallel
"""torch's ``SequenceParallel`` (it has no LoRA-specific behaviour)."""


def translate_to_lora(style: ParallelStyle) -> ParallelStyle:
    """The reference system's style translation; here the identity (returns ``style`` itself).

    `apply_tensor_parallel` makes any column- or row-parallel entry LoRA-aware when it meets a
    LoRA-wrapped linear (`expand_lora_plan`), so no style needs translating.
    """
    return style
