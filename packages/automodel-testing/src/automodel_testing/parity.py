"""Data-parallel parity runs: a sharded model against the same model in one process.

`train_parity` is called on every rank of a real process group. It builds the reference model and
the model to shard from the same seed, feeds the reference the global batch and each data-parallel
rank its own slice, and reports the largest differences of loss, logits, gradients and of the losses
over several optimizer steps. Tests assert on the report, so one launch can check many setups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from automodel_modules import is_dtensor
from automodel_testing.models import build_tiny_model, make_batch
from automodel_testing.numerics import normalize_fqn, to_full

__all__ = ["ParityReport", "causal_lm_loss", "train_parity"]


@dataclass
class ParityReport:
    """Largest absolute differences between a sharded run and its single-process reference."""

    loss: float
    logits: float
    grads: float
    worst_grad: str
    step_losses: list[float] = field(default_factory=list)
    reference_step_losses: list[float] = field(default_factory=list)
    missing_grads: list[str] = field(default_factory=list)
    """Parameters with a gradient on one side only."""
    model_class: str = ""

    @property
    def steps(self) -> float:
        """Largest difference of the per-step training losses."""
        pairs = zip(self.step_losses, self.reference_step_losses, strict=True)
        return max((abs(a - b) for a, b in pairs), default=0.0)

    def check(self, *, atol: float, step_atol: float | None = None, label: str = "") -> None:
        """Raise `AssertionError` naming the worst quantity when any difference exceeds its tolerance."""
        problems = []
        if self.missing_grads:
            problems.append(f"gradients present on one side only: {self.missing_grads}")
        for name in ("loss", "logits", "grads"):
            value = getattr(self, name)
            if not value <= atol:
                where = f" ({self.worst_grad})" if name == "grads" else ""
                problems.append(f"{name} differs by {value:.3g}{where} > {atol:g}")
        tol = step_atol if step_atol is not None else atol
        if not self.steps <= tol:
            problems.append(
                f"training losses differ by {self.steps:.3g} > {tol:g}: "
                f"{self.step_losses} vs {self.reference_step_losses}"
            )
        if problems:
            raise AssertionError(f"{label} [{self.model_class}]: " + "; ".join(problems))


@contextlib.contextmanager
def _loss_context(logits: torch.Tensor) -> Iterator[None]:
    # A vocab-sharded DTensor of logits needs loss_parallel for cross entropy to stay sharded.
    if is_dtensor(logits):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            yield
    else:
        yield


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; works for plain logits and vocab-sharded DTensor logits."""
    vocab = logits.shape[-1]
    with _loss_context(logits):
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1).to(logits.device)
        )


def _forward(model: nn.Module, batch: Mapping[str, torch.Tensor], device: torch.device) -> tuple[Any, Any]:
    out = model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device))
    logits = out.logits if hasattr(out, "logits") else out
    return logits, causal_lm_loss(logits, batch["labels"])


def _backward(loss: torch.Tensor, logits: torch.Tensor) -> None:
    with _loss_context(logits):
        loss.backward()


def train_parity(
    family: str,
    parallelize: Callable[[nn.Module], nn.Module],
    *,
    dp_rank: int,
    dp_size: int,
    dp_group: dist.ProcessGroup | None,
    batch_size: int = 4,
    seq_len: int = 16,
    steps: int = 3,
    lr: float = 1e-2,
    seed: int = 0,
    device: str = "cpu",
    model_overrides: Mapping[str, Any] | None = None,
    before_backward: Callable[[nn.Module], None] | None = None,
) -> ParityReport:
    """Train ``parallelize(model)`` and the plain model side by side and report the differences.

    Collective: every rank of the default group calls it; ``dp_group`` is this rank's data-parallel
    group (``None`` when data parallelism is 1), over which the local losses are averaged. Rank
    ``dp_rank`` gets rows ``[dp_rank * b, (dp_rank + 1) * b)`` of the global batch (``b =
    batch_size // dp_size``). Gradients of DTensor parameters are gathered with ``full_tensor()``.

    Args:
        family: A tiny model family of `automodel_testing.models`.
        parallelize: Shards the model in place (or returns a wrapper); may move it to ``device``.
        dp_rank: This rank's index along the data-parallel axes.
        dp_size: Number of data-parallel ranks; must divide ``batch_size``.
        dp_group: Process group of the data-parallel ranks.
        batch_size: Global batch size.
        seq_len: Sequence length.
        steps: Optimizer (AdamW) steps whose losses are compared.
        lr: Learning rate of both optimizers.
        seed: Seed of the weights and the batch.
        device: Device of the sharded model's inputs.
        model_overrides: Extra tiny-config fields.
        before_backward: Called with the sharded model before each backward (e.g. gradient-sync toggles).

    Returns:
        The report; call `ParityReport.check` on it (in the test process).
    """
    if batch_size % dp_size:
        raise ValueError(f"batch_size={batch_size} must divide by dp_size={dp_size}")
    overrides = dict(model_overrides or {})
    reference = build_tiny_model(family, seed=seed, **overrides)
    sharded = parallelize(build_tiny_model(family, seed=seed, **overrides))
    batch = make_batch(reference.config.vocab_size, batch_size, seq_len, seed=seed + 1)
    local = batch_size // dp_size
    local_batch = {k: v[dp_rank * local : (dp_rank + 1) * local] for k, v in batch.items()}
    dev = torch.device(device)

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    opt = torch.optim.AdamW(sharded.parameters(), lr=lr)
    report = ParityReport(loss=0.0, logits=0.0, grads=0.0, worst_grad="", model_class=type(sharded).__name__)
    for step in range(steps):
        ref_logits, ref_loss = _forward(reference, batch, torch.device("cpu"))
        ref_loss.backward()
        logits, loss = _forward(sharded, local_batch, dev)
        if before_backward is not None:
            before_backward(sharded)
        _backward(loss, logits)
        global_loss = to_full(loss).float()  # a vocab-parallel loss is a replicated DTensor
        if dp_group is not None and dp_size > 1:
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG, group=dp_group)
        report.step_losses.append(float(global_loss.item()))
        report.reference_step_losses.append(float(ref_loss.item()))
        if step == 0:
            report.loss = abs(float(global_loss.item()) - float(ref_loss.item()))
            full_logits = to_full(logits).float()
            report.logits = float(
                (full_logits - ref_logits.detach()[dp_rank * local : (dp_rank + 1) * local]).abs().max()
            )
            ref_grads = {normalize_fqn(n): p.grad for n, p in reference.named_parameters()}
            for name, param in sharded.named_parameters():
                key = normalize_fqn(name)
                ref_grad = ref_grads.get(key)
                if param.grad is None or ref_grad is None:
                    if (param.grad is None) != (ref_grad is None):
                        report.missing_grads.append(key)
                    continue
                diff = float((to_full(param.grad).float() - ref_grad.float()).abs().max())
                if diff >= report.grads:
                    report.grads, report.worst_grad = diff, key
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    return report
