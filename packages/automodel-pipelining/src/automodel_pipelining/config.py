"""`PipelineConfig`: what `AutoPipeline` splits and how it schedules the stages.

Field names and defaults follow NeMo AutoModel, so configs written for it work here unchanged. The
config is validated when it is built (errors name the field and the offending value) and never mutated
by the code that uses it. This module imports nothing heavy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from automodel_mesh.config_dict import ConfigDict
from automodel_pipelining.schedules import normalize_schedule_name

__all__ = ["PipelineConfig"]

_ROUNDING = ("up", "down")


def _positive_int(obj: object, name: str, *, allow_none: bool = False) -> None:
    value = getattr(obj, name)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"PipelineConfig.{name} must be {expected}, got {value!r}")


def _bool(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise ValueError(f"PipelineConfig.{name} must be a bool, got {value!r}")


def _check_fqn_parts(value: object) -> tuple[tuple[str, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(
            "PipelineConfig.module_fqns_per_model_part must be a list of lists of module FQNs "
            f"(one list per stage), got {value!r}"
        )
    parts: list[tuple[str, ...]] = []
    for index, part in enumerate(value):
        if isinstance(part, str) or not isinstance(part, Sequence):
            raise ValueError(
                f"PipelineConfig.module_fqns_per_model_part[{index}] must be a list of module FQNs, "
                f"got {part!r}"
            )
        bad = [fqn for fqn in part if not isinstance(fqn, str) or not fqn]
        if bad:
            raise ValueError(
                f"PipelineConfig.module_fqns_per_model_part[{index}] holds non-FQN entries {bad!r}"
            )
        parts.append(tuple(part))
    if not parts:
        raise ValueError("PipelineConfig.module_fqns_per_model_part is empty; give one list per stage")
    return tuple(parts)


@dataclass(kw_only=True)
class PipelineConfig(ConfigDict):
    """Pipeline-parallel settings for `AutoPipeline` (field names and defaults as in NeMo AutoModel).

    Sizes: ``pp_batch_size`` is the batch one pipeline (one data-parallel replica) processes per
    `AutoPipeline.step`; it is cut into ``pp_batch_size // pp_microbatch_size`` microbatches.
    """

    pp_schedule: str | None = "1f1b"
    """Schedule name, case-insensitive, ``_``/``-`` ignored: ``gpipe``, ``1f1b``, ``interleaved_1f1b``,
    ``looped_bfs``, ``interleaved_zero_bubble`` (alias ``zero_bubble``), ``zbv_zero_bubble`` (alias
    ``zbv``), ``dualpipev``. Ignored (with a warning) when ``pp_schedule_csv`` is set."""
    pp_schedule_csv: str | None = None
    """Path of a CSV schedule (torch's ``_PipelineScheduleRuntime`` compute-only format: one row per
    pipeline rank, actions like ``0F0``, ``2B1``). Stage placement is read from it."""
    pp_microbatch_size: int = 1
    """Rows per microbatch."""
    pp_batch_size: int = 1
    """Rows per step and data-parallel replica; must be a multiple of ``pp_microbatch_size``."""
    layers_per_stage: int | None = None
    """Decoder layers per (virtual) stage; sets the number of stages to ``ceil(layers / this)``.
    ``None``: one stage per rank for single-stage schedules (GPipe, 1F1B), two for the others."""
    round_virtual_stages_to_pp_multiple: Literal["up", "down"] | None = None
    """When ``layers_per_stage`` gives a stage count that is not a multiple of the pipeline size: round it
    ``"up"`` or ``"down"`` to one; ``None`` raises a ``ValueError`` instead."""
    module_fqns_per_model_part: Sequence[Sequence[str]] | None = None
    """Explicit split: one list of module FQNs (of the full model) per stage, overriding the automatic
    split, e.g. ``[["model.embed_tokens", "model.layers.0", "model.rotary_emb"], [...]]``."""
    patch_inner_model: bool = True
    """Replace the base model's forward (``model.model``) with the stage forward: takes token ids on the
    first stage or hidden states elsewhere, runs the stage's layers, returns hidden states."""
    patch_causal_lm_model: bool = True
    """Replace the causal-LM wrapper's forward with the stage forward: base model, then the LM head on the
    last stage; returns a tensor (hidden states, or logits on the last stage)."""
    patch_stage_backward_maybe_with_nosync: bool = False
    """Also apply the gradient-sync policy (``defer_fsdp_grad_sync``) to FSDP modules *inside* a stage
    whose root is not an FSDP module (e.g. experts sharded on their own mesh); torch only handles a stage
    whose root module is FSDP."""
    dtype: torch.dtype | None = None
    """dtype of the activations sent between stages, for static shapes (``pp_seq_len``); ``None``: the
    dtype the strategy computes in (``instantiate_infrastructure`` hands over FSDP2's mixed precision),
    else the model's parameter dtype."""
    scale_grads_in_schedule: bool = False
    """``True``: the schedule divides gradients by the number of microbatches (right for a mean-reduced
    ``loss_fn``). ``False``: gradients are the sum over microbatches; scale them yourself, e.g. with
    `AutoPipeline.scale_grads` (or by a token count when ``loss_fn`` sums)."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """``loss_fn(logits, target) -> scalar`` for the last stage; usually passed to `AutoPipeline.build`."""
    pp_seq_len: int | None = None
    """Sequence length for static stage shapes (no shape exchange on the first step); ``None`` infers
    shapes from the first batch. Change it later with `AutoPipeline.update_seq_len`."""
    balance_stages: bool = False
    """Spread the decoder layers so the stages' compute is even rather than their layer counts
    (automodel's own field): the LM head and the other modules of the first and last stages count as
    the fraction of a layer their matrix parameters are (`automodel_pipelining.costs`), and the split
    makes the most expensive stage as cheap as it can be (`split_layers_by_cost`); with a large
    vocabulary the last stage gets fewer layers. ``False`` (NeMo AutoModel's split): the same number of
    layers per stage, the remainder on the early stages. Not together with ``module_fqns_per_model_part``."""

    def __post_init__(self) -> None:
        if self.pp_schedule is None and self.pp_schedule_csv is None:
            raise ValueError("PipelineConfig needs pp_schedule or pp_schedule_csv; both are None")
        if self.pp_schedule is not None:
            if not isinstance(self.pp_schedule, str):
                raise ValueError(
                    f"PipelineConfig.pp_schedule must be a str or None, got {self.pp_schedule!r}"
                )
            try:
                normalize_schedule_name(self.pp_schedule)
            except ValueError as exc:
                raise ValueError(f"PipelineConfig.pp_schedule: {exc}") from None
        if self.pp_schedule_csv is not None and (
            not isinstance(self.pp_schedule_csv, str) or not self.pp_schedule_csv
        ):
            raise ValueError(
                f"PipelineConfig.pp_schedule_csv must be a file path or None, got {self.pp_schedule_csv!r}"
            )
        _positive_int(self, "pp_microbatch_size")
        _positive_int(self, "pp_batch_size")
        if self.pp_batch_size % self.pp_microbatch_size:
            raise ValueError(
                f"PipelineConfig.pp_batch_size={self.pp_batch_size} is not divisible by "
                f"pp_microbatch_size={self.pp_microbatch_size}: the batch does not split into microbatches"
            )
        _positive_int(self, "layers_per_stage", allow_none=True)
        _positive_int(self, "pp_seq_len", allow_none=True)
        if self.round_virtual_stages_to_pp_multiple not in (None, *_ROUNDING):
            raise ValueError(
                "PipelineConfig.round_virtual_stages_to_pp_multiple must be 'up', 'down' or None, got "
                f"{self.round_virtual_stages_to_pp_multiple!r}"
            )
        _check_fqn_parts(self.module_fqns_per_model_part)
        _bool(
            self,
            "patch_inner_model",
            "patch_causal_lm_model",
            "patch_stage_backward_maybe_with_nosync",
            "scale_grads_in_schedule",
            "balance_stages",
        )
        if self.balance_stages and self.module_fqns_per_model_part is not None:
            raise ValueError(
                "PipelineConfig.balance_stages=True chooses the split, but module_fqns_per_model_part "
                "gives one: set balance_stages=False to keep the explicit split, or drop "
                "module_fqns_per_model_part"
            )
        if self.layers_per_stage is not None and self.module_fqns_per_model_part is not None:
            warnings.warn(
                "PipelineConfig.layers_per_stage is ignored: module_fqns_per_model_part gives the stages",
                stacklevel=3,
            )
        if self.layers_per_stage is not None and self.pp_schedule_csv is not None:
            warnings.warn(
                "PipelineConfig.layers_per_stage is ignored: pp_schedule_csv fixes the stage count",
                stacklevel=3,
            )
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"PipelineConfig.dtype must be a torch.dtype or None, got {self.dtype!r}")
        if self.dtype is not None and self.pp_seq_len is None:
            warnings.warn(
                "PipelineConfig.dtype is ignored: only static stage shapes (pp_seq_len) read it; set "
                "pp_seq_len, or drop dtype (torch infers the shapes and dtypes from a first forward)",
                stacklevel=3,
            )
        if self.patch_causal_lm_model and not self.patch_inner_model:
            warnings.warn(
                "PipelineConfig.patch_inner_model=False is ignored: patch_causal_lm_model=True replaces the "
                "whole model's forward, the base model's included; set both to False to keep the model's "
                "own forward",
                stacklevel=3,
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError(f"PipelineConfig.loss_fn must be callable or None, got {self.loss_fn!r}")

    @property
    def n_microbatches(self) -> int:
        """Microbatches per step: ``pp_batch_size // pp_microbatch_size``."""
        return self.pp_batch_size // self.pp_microbatch_size

    def stage_count(self, pp_size: int, num_layers: int | None = None) -> int | None:
        """Stages the layers are split into on ``pp_size`` ranks, when known before the model is built.

        From ``module_fqns_per_model_part``, else the schedule's stages per rank, else (``layers_per_stage``)
        from ``num_layers``; None when the schedule is a CSV file or the layer count is needed but not given.
        """
        from automodel_pipelining.schedules import resolve_schedule

        if self.module_fqns_per_model_part is not None:
            return len(self.module_fqns_per_model_part)
        spec = resolve_schedule(self.pp_schedule, self.pp_schedule_csv)
        if spec is None:
            return None
        if self.layers_per_stage is not None:
            return None if num_layers is None else -(-num_layers // self.layers_per_stage)
        return pp_size * spec.default_stages_per_rank
