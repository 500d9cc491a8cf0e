"""Summaries of pipeline stages: the modules they hold and their parameter counts (read-only helpers)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["count_params", "pretty_print_stages"]


def count_params(module: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements of ``module``; DTensors count their global size (meta-safe)."""
    seen: set[int] = set()
    total = 0
    for param in module.parameters():
        if id(param) in seen or (trainable_only and not param.requires_grad):
            continue
        seen.add(id(param))
        total += int(param.numel())
    return total


def pretty_print_stages(
    stage_ids: Sequence[int],
    parts: Sequence[nn.Module],
    fqns: Sequence[Sequence[str]],
    *,
    header: str = "",
    max_modules: int | None = None,
    trainable_only: bool = False,
) -> str:
    """A readable table: one block per local stage with its module FQNs and parameter counts.

    ``max_modules`` caps the FQNs listed per stage (``...`` follows); ``trainable_only`` counts only
    trainable parameters.
    """
    lines = [header] if header else []
    for stage_id, part, part_fqns in zip(stage_ids, parts, fqns, strict=True):
        if trainable_only:
            counts = f"{count_params(part, trainable_only=True):,} trainable parameters"
        else:
            counts = (
                f"{count_params(part):,} parameters ({count_params(part, trainable_only=True):,} trainable)"
            )
        lines.append(f"stage {stage_id}: {counts}, {len(part_fqns)} modules")
        shown = list(part_fqns) if max_modules is None else list(part_fqns)[:max_modules]
        lines.extend(f"    {fqn}" for fqn in shown)
        if len(shown) < len(part_fqns):
            lines.append("    ...")
    return "\n".join(lines)
