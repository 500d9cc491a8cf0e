"""Evaluation: every evaluation row once, forward only; the exact mean token loss and its perplexity.

The rows are dealt to the data-parallel ranks in rounds (each rank one micro-batch, or one pipeline
batch, per round); a last round short of rows is filled with rows whose labels are all ignored. Each
rank sums its token losses, one ``all_reduce`` adds them up, and the loss is that sum over the number of
label tokens in the evaluation data: the same value on any layout.

FSDP2 after a no-grad forward: units that keep their parameters gathered for the backward (the root)
would stay gathered when no backward follows; `automodel_distributed.fsdp2.reshard_after_no_grad_forward`
(registered on every FSDP2 root by ``apply_fsdp2``) reshards them, so the next training step (and a
checkpoint) sees the sharded parameters the optimizer holds.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from automodel_all.cli.packing import IGNORE_INDEX, TokenRows
from automodel_all.cli.steps import ContextParallelism, TokenLoss, run_step
from automodel_distributed.strategy import StrategyManager

__all__ = ["evaluate"]


def _round(rows: TokenRows, start: int, count: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``count`` rows from ``start``; past the end, copies of row 0 with every label ignored."""
    index = torch.arange(start, start + count, device="cpu")  # host rows; batch() moves them
    missing = index >= len(rows)
    batch = rows.batch(torch.where(missing, torch.zeros_like(index), index), device)
    batch["labels"][missing.to(device)] = IGNORE_INDEX
    return batch


def evaluate(
    model: Any,
    rows: TokenRows,
    *,
    loss_fn: TokenLoss,
    strategy: StrategyManager,
    dp_rank: int,
    dp_size: int,
    rows_per_forward: int,
    tp_size: int,
    device: torch.device,
    pipeline: Any = None,
    context_parallel: ContextParallelism | None = None,
) -> dict[str, float]:
    """The mean token loss over ``rows`` (collective: every rank calls it with the same rows).

    Args:
        model: The model (outside pipelining).
        rows: The evaluation rows.
        loss_fn: The training loss (its denominator is set to 1 here and restored).
        strategy: The run's strategy manager (autocast).
        dp_rank: This rank's data-parallel index.
        dp_size: The data-parallel size.
        rows_per_forward: Rows per rank per forward: the micro-batch (the pipeline batch under PP).
        tp_size: Tensor-parallel ranks compute the same loss; the sum over ranks is divided by it.
        device: Where batches go.
        pipeline: The `AutoPipeline` under pipeline parallelism.
        context_parallel: The mesh and host runtime under context parallelism.

    Returns:
        ``eval_loss``, ``eval_ppl`` (``exp(eval_loss)``) and ``eval_tokens``.
    """
    label_tokens = int((rows.labels != IGNORE_INDEX).sum())
    per_round = rows_per_forward * dp_size
    saved, loss_fn.denominator = loss_fn.denominator, 1.0
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for start in range(0, len(rows), per_round):
                batch = _round(rows, start + dp_rank * rows_per_forward, rows_per_forward, device)
                local = run_step(
                    model if pipeline is None else None,
                    batch,
                    loss_fn=loss_fn,
                    micro_batch_size=rows_per_forward,
                    strategy=strategy,
                    pipeline=pipeline,
                    context_parallel=context_parallel,
                    backward=False,
                )
                total += local.double()
    finally:
        loss_fn.denominator = saved
    dist.all_reduce(total)
    loss = float(total) / (max(label_tokens, 1) * tp_size)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": label_tokens}
