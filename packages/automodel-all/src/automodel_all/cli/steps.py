"""One optimizer step of the worker: loss normalisation, forward/backward, clipping, learning rate.

Loss normalisation: each rank's loss is the *sum* of its token losses divided by
``N / dp_cp``, where ``N`` is the number of label tokens in the whole global batch and ``dp_cp`` the
number of ranks the strategy averages gradients over (data parallel x context parallel). The strategy's
averaging then yields the gradient of (sum of all token losses) / N: exactly what one process would
compute on the whole global batch, whatever the data-parallel size and the number of micro-batches.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_distributed.loss import MaskedCrossEntropy
from automodel_distributed.strategy import StrategyManager

__all__ = ["TokenLoss", "clip_gradients", "lr_at", "run_step"]


class TokenLoss(nn.Module):
    """``sum of token cross entropies / denominator`` (see the module docstring).

    Args:
        denominator: ``N / dp_cp`` (label tokens of the global batch over the averaging ranks).
    """

    def __init__(self, denominator: float) -> None:
        super().__init__()
        self.denominator = denominator
        self._ce = MaskedCrossEntropy(reduction="sum")

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The normalised loss of ``logits [..., vocab]`` against ``labels [...]``."""
        return self._ce(logits, labels) / self.denominator


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``total_steps`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def clip_gradients(params: list[nn.Parameter], max_norm: float, pp_group: Any = None) -> float:
    """Clip the global gradient norm over every rank's parameters; return the norm before clipping.

    DTensor gradients (FSDP2, TP) give the norm over their mesh; with pipeline stages the squares are
    summed over the ``pp`` group. Collective over the gradients' meshes (and ``pp_group``).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
    else:
        norm = torch.zeros(())
    norm = norm.float()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        square = norm.square()
        dist.all_reduce(square, group=pp_group)
        norm = square.sqrt()
    if grads:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(grads[0].device))
    return float(norm)


def run_step(
    model: Any,
    rows: torch.Tensor,
    *,
    loss_fn: TokenLoss,
    micro_batch_size: int,
    strategy: StrategyManager,
    pipeline: Any = None,
    cp_mesh: Any = None,
) -> torch.Tensor:
    """Forward and backward over this rank's rows of one step; gradients accumulate in ``.grad``.

    The strategy decides the rest: each forward (and loss) runs under `StrategyManager.autocast` (its
    ``autocast_dtype``; the backward outside it, as torch recommends, except inside a pipeline schedule,
    which runs both), each micro-batch under `StrategyManager.gradient_sync` (gradients reduced on the
    last one only).

    Args:
        model: The model (`apply_model_infrastructure`'s result), or unused under pipelining.
        rows: ``[rows, seq + 1]`` token rows of this data-parallel rank (on the model's device).
        loss_fn: The normalised loss.
        micro_batch_size: Rows per forward pass (outside pipelining).
        strategy: The run's strategy manager (``automodel_distributed.strategy.as_strategy``).
        pipeline: The `AutoPipeline`, which splits ``rows`` into its own microbatches.
        cp_mesh: The mesh context when context parallelism is on (sequences are sharded over ``cp``).

    Returns:
        The sum of this rank's token losses (detached; zero on pipeline ranks without the last stage).
    """
    inputs, labels = rows[:, :-1], rows[:, 1:]
    positions = torch.arange(inputs.shape[1], device=rows.device).unsqueeze(0).expand_as(inputs)
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    if pipeline is not None:
        with strategy.autocast():
            losses = pipeline.step(inputs, target=labels, position_ids=positions)
        for loss in losses:
            total += loss.detach().float() * loss_fn.denominator
        return total
    count, rest = divmod(inputs.shape[0], micro_batch_size)
    if count == 0 or rest:
        raise ValueError(f"{inputs.shape[0]} rows do not split into micro-batches of {micro_batch_size}")
    for index in range(count):
        part = slice(index * micro_batch_size, (index + 1) * micro_batch_size)
        with strategy.gradient_sync(model, enabled=index == count - 1):
            if cp_mesh is not None:
                from automodel_distributed.context_parallel import (
                    context_parallel_inputs,
                    context_parallel_region,
                )

                batch = context_parallel_inputs(
                    {"input_ids": inputs[part], "position_ids": positions[part], "shift_labels": labels[part]}
                )
                # CPU meshes (gloo) run ring attention through automodel's opt-in CPU backend.
                cpu_ring = cp_mesh.device_type == "cpu"
                with context_parallel_region(cp_mesh, batch, cpu_ring_attention=cpu_ring) as local:
                    with strategy.autocast():
                        logits = model(
                            input_ids=local["input_ids"], position_ids=local["position_ids"]
                        ).logits
                        loss = loss_fn(logits, local["shift_labels"])
                    loss.backward()
            else:
                with strategy.autocast():
                    logits = model(input_ids=inputs[part], position_ids=positions[part]).logits
                    loss = loss_fn(logits, labels[part])
                loss.backward()
        total += loss.detach().float() * loss_fn.denominator
    return total
