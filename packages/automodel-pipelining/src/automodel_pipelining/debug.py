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
    stage_ids: Sequence[int], parts: Sequence[nn.Module], fqns: Sequence[Sequence[str]], *, header: str = ""
) -> str:
    """A readable table: one block per local stage with its module FQNs and parameter counts."""
    lines = [header] if header else []
    for stage_id, part, part_fqns in zip(stage_ids, parts, fqns, strict=True):
        total = count_params(part)
        trainable = count_params(part, trainable_only=True)
        lines.append(
            f"stage {stage_id}: {total:,} parameters ({trainable:,} trainable), {len(part_fqns)} modules"
        )
        lines.extend(f"    {fqn}" for fqn in part_fqns)
    return "\n".join(lines)
