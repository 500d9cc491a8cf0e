"""Small process-group helpers: rank, barrier, and agreeing on failure so no rank is left waiting."""

from __future__ import annotations

import torch
import torch.distributed as dist

from automodel_modules import collective_device

__all__ = ["agree_on_failure", "barrier", "global_rank", "is_distributed", "rank_of", "world_of"]


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """Whether a default process group exists (and, if ``group`` is given, it has several ranks)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def rank_of(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_of(group: dist.ProcessGroup | None = None) -> int:
    """Size of ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (itself for the world or without a process group)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return rank
    return dist.get_global_rank(group, rank)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier`` when distributed; a no-op otherwise."""
    if is_distributed(group):
        dist.barrier(group)


def agree_on_failure(error: BaseException | None, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Every rank reports whether its step failed; if any did, every rank raises.

    Collectives over ``group``: one ``all_reduce`` of a flag, plus one ``all_gather_object`` of the
    messages when some rank failed. Every rank must call this, failed or not: that is the point (a rank
    that failed alone would otherwise leave the others waiting in their next collective). Without a
    process group it simply re-raises ``error``.

    Raises:
        The rank's own error if it failed; otherwise a ValueError naming the ranks that failed and the
        first of their messages.
    """
    if not is_distributed(group):
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    gathered: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, message, group=group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(gathered) if m is not None]
    if failed:
        ranks = [r for r, _ in failed]
        raise ValueError(f"{what} failed on rank(s) {ranks}: {failed[0][1]}")
