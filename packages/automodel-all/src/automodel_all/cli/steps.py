"""One optimizer step of the worker: loss normalisation, forward/backward, clipping, learning rate.

Loss normalisation: each rank's loss is the *sum* of its token losses divided by
``N / dp_cp``, where ``N`` is the number of label tokens in the whole global batch and ``dp_cp`` the
number of ranks the strategy averages gradients over (data parallel x context parallel). The strategy's
averaging then yields the gradient of (sum of all token losses) / N: exactly what one process would
compute on the whole global batch, whatever the data-parallel size and the number of micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from automodel_all.cli.packing import model_inputs, take_rows
from automodel_distributed.host_runtime import HostRuntime
from automodel_distributed.loss import MaskedCrossEntropy
from automodel_distributed.strategy import StrategyManager
from automodel_mesh import MeshContext

__all__ = ["ContextParallelism", "TokenLoss", "clip_gradients", "lr_at", "run_step"]


@dataclass(frozen=True)
class ContextParallelism:
    """What a step needs to shard its sequences over the ``cp`` axis."""

    mesh: MeshContext
    """The run's mesh (its ``cp`` axis)."""
    host_runtime: HostRuntime | None
    """The CPU runtime on a CPU mesh (ring attention on CPU tensors), else None."""
    ulysses_degree: int = 1
    """``parallelism.cp_ulysses_degree``: 1 ring attention, the cp size all-to-all attention, a divisor
    between ring attention between all-to-all groups."""


class TokenLoss(nn.Module):
    """``sum of token cross entropies / denominator`` (see the module docstring).

    Args:
        denominator: ``N / dp_cp`` (label tokens of the global batch over the averaging ranks).
        compiled: Compile the cross entropy (`MaskedCrossEntropy`'s ``compiled``; the job's
            ``compile.compile_loss``).
    """

    accepts_dtensor_logits: ClassVar[bool] = MaskedCrossEntropy.accepts_dtensor_logits

    def __init__(self, denominator: float, compiled: bool = False) -> None:
        super().__init__()
        self.denominator = denominator
        self._ce = MaskedCrossEntropy(reduction="sum", compiled=compiled)

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


def _by_mesh(params: list[nn.Parameter]) -> list[tuple[list[nn.Parameter], list[torch.Tensor]]]:
    # DTensor ops take operands of one mesh: experts kept out of FSDP live on ``ep``, the rest on the
    # data-parallel (and tp) meshes. Plain gradients form a group of their own.
    groups: dict[Any, tuple[list[nn.Parameter], list[torch.Tensor]]] = {}
    for param in params:
        if param.grad is not None:
            group = groups.setdefault(getattr(param.grad, "device_mesh", None), ([], []))
            group[0].append(param)
            group[1].append(param.grad)
    return list(groups.values())


def clip_gradients(params: list[nn.Parameter], max_norm: float | None, pp_group: Any = None) -> float:
    """The global gradient norm over every rank's parameters (before clipping); clip to ``max_norm``.

    DTensor gradients (FSDP2, TP, EP) give the norm over their mesh, one mesh at a time, and the squares
    of the meshes' norms are summed; with pipeline stages the squares are also summed over the ``pp``
    group. ``max_norm=None`` only measures. Collective over the gradients' meshes (and ``pp_group``).
    """
    groups = _by_mesh(params)
    device = groups[0][1][0].device if groups else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for _, grads in groups:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        square = square + norm.float().to(device).square()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(square, group=pp_group)
    norm = square.sqrt()
    if max_norm is not None and bool(torch.isfinite(norm)):
        for group, _ in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return float(norm)


def _forward_loss(
    model: Any,
    batch: dict[str, torch.Tensor],
    loss_fn: TokenLoss,
    strategy: StrategyManager,
    context_parallel: ContextParallelism | None,
    backward: bool,
) -> torch.Tensor:
    """One forward (under the strategy's autocast) and backward of ``batch``; the loss, detached."""
    if context_parallel is None:
        with strategy.autocast():
            logits = model(**model_inputs(batch)).logits
            loss = loss_fn(logits, batch["labels"])
        if backward:
            loss.backward()
        return loss.detach()
    with _cp_region(context_parallel, batch, model) as local:
        with strategy.autocast():  # forward and backward inside the region
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            loss = loss_fn(logits, local["shift_labels"])
        if backward:
            loss.backward()
    return loss.detach()


def _cp_region(
    context_parallel: ContextParallelism, batch: dict[str, torch.Tensor], model: Any
) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """The context-parallel region of ``batch``: yields its shard, labels as ``shift_labels``."""
    from automodel_distributed.context_parallel import context_parallel_inputs, context_parallel_region

    sharded = context_parallel_inputs(
        {
            "input_ids": batch["input_ids"],
            "position_ids": batch["position_ids"],
            "shift_labels": batch["labels"],
        }
    )
    # CPU meshes (gloo) run ring attention through the job's CPU runtime.
    return context_parallel_region(
        context_parallel.mesh,
        sharded,
        host_runtime=context_parallel.host_runtime,
        ulysses_degree=context_parallel.ulysses_degree,
        model=model,
    )


def run_step(
    model: Any,
    batch: dict[str, torch.Tensor],
    *,
    loss_fn: TokenLoss,
    micro_batch_size: int,
    strategy: StrategyManager,
    pipeline: Any = None,
    context_parallel: ContextParallelism | None = None,
    backward: bool = True,
) -> torch.Tensor:
    """Forward (and backward) over this rank's rows of one step; gradients accumulate in ``.grad``.

    The strategy decides the rest: each forward (and loss) runs under `StrategyManager.autocast` (its
    ``autocast_dtype``; the backward outside it, as torch recommends, except inside a pipeline schedule,
    which runs both), each micro-batch under `StrategyManager.gradient_sync` (gradients reduced on the
    last one only).

    Args:
        model: The model (`apply_model_infrastructure`'s result), or unused under pipelining.
        batch: This rank's rows (`TokenRows.batch`): ``input_ids``, ``labels`` (already shifted, -100
            where nothing is predicted) and ``position_ids`` (restarting per packed document), each
            ``[rows, seq]``, and the rows' image inputs when the data has images, on the model's device.
        loss_fn: The normalised loss (its ``denominator`` set for this step).
        micro_batch_size: Rows per forward pass (outside pipelining).
        strategy: The run's strategy manager (``automodel_distributed.strategy.as_strategy``).
        pipeline: The `AutoPipeline`, which splits the rows into its own microbatches.
        context_parallel: The mesh and host runtime under context parallelism (sequences are sharded
            over ``cp``); None otherwise.
        backward: False for evaluation: forward only (call under ``torch.no_grad()``).

    Returns:
        The sum of this rank's token losses (detached; zero on pipeline ranks without the last stage).
    """
    inputs, labels = batch["input_ids"], batch["labels"]
    total = torch.zeros((), dtype=torch.float32, device=inputs.device)
    if pipeline is not None:
        region: contextlib.AbstractContextManager[dict[str, Any]] = contextlib.nullcontext(
            {"input_ids": inputs, "shift_labels": labels, "position_ids": batch["position_ids"]}
        )
        if context_parallel is not None:
            region = _cp_region(context_parallel, batch, pipeline.parts)
        with region as local, strategy.autocast():
            losses = pipeline.step(
                local["input_ids"], target=local["shift_labels"], position_ids=local["position_ids"]
            )
        for loss in losses:
            total += loss.detach().float() * loss_fn.denominator
        return total
    count, rest = divmod(inputs.shape[0], micro_batch_size)
    if count == 0 or rest:
        raise ValueError(f"{inputs.shape[0]} rows do not split into micro-batches of {micro_batch_size}")
    for index in range(count):
        part = slice(index * micro_batch_size, (index + 1) * micro_batch_size)
        micro = take_rows(batch, part)
        sync = (
            strategy.gradient_sync(model, enabled=index == count - 1)
            if backward
            else contextlib.nullcontext()
        )
        with sync:
            loss = _forward_loss(model, micro, loss_fn, strategy, context_parallel, backward)
        total += loss.float() * loss_fn.denominator
    return total
