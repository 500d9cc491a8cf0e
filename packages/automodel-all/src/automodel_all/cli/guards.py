"""Per-step checks every rank agrees on: a stop request (preemption) and NaN/Inf losses or gradients.

One ``all_reduce`` per step carries everything (`StepStatus`): this rank's loss sum, whether a stop
signal reached it, and one slot per rank for "my loss is not finite" and "my gradients are not
finite". Every rank therefore takes the same decision at the same step, and an error can name the ranks.

Preemption: SIGTERM (what a scheduler sends before it kills a job) and SIGUSR1 (what Slurm sends ahead
of a time limit, with ``--signal=USR1@<seconds>``) set a flag (`StopRequest`); the loop finishes the
step, saves a checkpoint and the worker exits 0. The launcher forwards both signals to its workers.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["STOP_SIGNALS", "NonFiniteError", "StepStatus", "StopRequest", "local_grads_finite"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that make the workers checkpoint and exit."""


class StopRequest:
    """Remembers the first stop signal this process received (`install` sets the handlers)."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None

    def install(self) -> StopRequest:
        """Handle `STOP_SIGNALS` in this process from now on (main thread only)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signal is not None


class NonFiniteError(FloatingPointError):
    """A NaN or Inf loss or gradient norm (raised on every rank, naming the step and the ranks)."""


def local_grads_finite(params: list[nn.Parameter]) -> bool:
    """Whether every gradient this rank holds (its shards) is finite. Local: no collective.

    One flag per gradient stays on its device; one host sync per device (not one per gradient, which
    on a GPU would stall the stream once per parameter).
    """
    from torch.distributed.tensor import DTensor

    flags: dict[torch.device, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.numel():
            flags.setdefault(local.device, []).append(torch.isfinite(local).all())
    return all(bool(torch.stack(found).all()) for found in flags.values())


@dataclass(frozen=True)
class StepStatus:
    """What the ranks agreed on after one step's forward and backward.

    Attributes:
        loss_sum: The sum over ranks of their token-loss sums.
        stop: Some rank received a stop signal.
        bad_loss: Ranks whose loss sum is NaN or Inf.
        bad_grads: Ranks holding a NaN or Inf gradient.
        slowest_rank: The rank that reached the agreement last (the one the others waited for).
        slowest_seconds: Its time since the previous agreement (``seconds`` of `agree`).
    """

    loss_sum: float
    stop: bool
    bad_loss: list[int]
    bad_grads: list[int]
    slowest_rank: int = 0
    slowest_seconds: float = 0.0

    @property
    def finite(self) -> bool:
        """Neither the loss nor any gradient is NaN or Inf."""
        return not (self.bad_loss or self.bad_grads)

    @classmethod
    def agree(
        cls,
        local_loss: torch.Tensor,
        *,
        stop: bool,
        grads_finite: bool,
        device: torch.device,
        seconds: float = 0.0,
    ) -> StepStatus:
        """All-reduce this rank's view (one ``all_reduce`` over the world; collective).

        A non-finite loss is reported in its slot and left out of the sum (so the sum stays readable).
        ``seconds`` is this rank's time since a point every rank shares (the previous agreement, which
        all leave together); the rank with the most arrived last, and is named.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        loss = float(local_loss)  # the one host sync of the step: the loss is final here
        finite = math.isfinite(loss)
        status = torch.zeros(2 + 3 * world, dtype=torch.float64, device=device)
        status[0] = loss if finite else 0.0
        status[1] = float(stop)
        status[2 + rank] = float(not finite)
        status[2 + world + rank] = float(not grads_finite)
        status[2 + 2 * world + rank] = seconds
        dist.all_reduce(status)
        values: Any = status.cpu().tolist()
        times = values[2 + 2 * world :]
        slowest = max(range(world), key=lambda r: times[r])
        return cls(
            loss_sum=float(values[0]),
            stop=values[1] > 0,
            bad_loss=[r for r in range(world) if values[2 + r] > 0],
            bad_grads=[r for r in range(world) if values[2 + world + r] > 0],
            slowest_rank=slowest,
            slowest_seconds=float(times[slowest]),
        )

    def describe(self, step: int, grad_norm: float | None = None) -> str:
        """What was not finite, for a message naming the step (1-based) and the ranks."""
        parts = []
        if self.bad_loss:
            parts.append(f"the loss is NaN or Inf on rank(s) {self.bad_loss}")
        if self.bad_grads:
            parts.append(f"gradients hold NaN or Inf on rank(s) {self.bad_grads}")
        if grad_norm is not None:
            parts.append(f"the global gradient norm is {grad_norm} (on every rank)")
        return f"step {step}: " + "; ".join(parts)
