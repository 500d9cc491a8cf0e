"""Masked cross entropy: the loss the orchestration layer falls back to.

`MaskedCrossEntropy` takes logits and labels that are already aligned (the data pipeline shifts
labels for causal language modelling, as in NeMo AutoModel), ignores positions whose label is
``ignore_index`` or whose ``mask`` is zero, and can normalise a summed loss by a token count known to
the trainer (the label tokens of the whole global batch, so that gradient accumulation and data
parallelism give the same gradients as one big batch).

DTensor logits sharded on the vocabulary (the built-in tensor-parallel plans' LM head) stay sharded: the
loss is `automodel_distributed.vocab_parallel_loss.vocab_parallel_cross_entropy` over the shard's group,
so no rank ever holds ``tokens x vocab`` values; other DTensor logits are gathered with ``full_tensor()``.

``compiled=True`` runs the upcast and the cross entropy of plain logits as one ``torch.compile``d
function, as torchtitan compiles its loss: inductor fuses the fp32 copy and the log-softmax away, so
the loss keeps the logits in their own dtype (and two values per token) for backward instead of an
fp32 copy, and their gradient is made in that dtype (at 128k vocabulary and 16k tokens: 4 GiB saved
instead of 8, and no 8 GiB fp32 gradient). Vocabulary-parallel logits keep their sharded loss.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from automodel_distributed.vocab_parallel_loss import vocab_parallel_cross_entropy, vocab_shard

__all__ = ["MaskedCrossEntropy"]

Reduction = Literal["sum", "mean", "none"]


class MaskedCrossEntropy(nn.Module):
    """Cross entropy over the unmasked label tokens.

    Args:
        fp32_upcast: Compute in float32 (bf16 logits lose precision in log-softmax).
        ignore_index: Label value that marks positions without a loss.
        reduction: ``"sum"`` (divided by ``num_label_tokens`` when given), ``"mean"`` over the unmasked
            tokens, or ``"none"`` (one value per position, 0 where masked).
        compiled: Compute the token losses of plain logits with ``torch.compile`` (module docstring):
            the same values, without the fp32 copies. Vocabulary-parallel logits warn once and keep
            their own (sharded) loss.

    Raises:
        ValueError: An unknown ``reduction``, or ``num_label_tokens`` with a reduction other than
            ``"sum"``.
    """

    accepts_dtensor_logits: ClassVar[bool] = True
    """It takes DTensor logits (vocab-sharded ones stay sharded): a pipeline's last stage
    (``automodel_pipelining``) hands them on without gathering them. A loss of one's own may declare the
    same."""

    def __init__(
        self,
        fp32_upcast: bool = True,
        ignore_index: int = -100,
        reduction: Reduction = "sum",
        compiled: bool = False,
    ) -> None:
        super().__init__()
        if reduction not in ("sum", "mean", "none"):
            raise ValueError(f"MaskedCrossEntropy.reduction={reduction!r}; use 'sum', 'mean' or 'none'")
        if not isinstance(compiled, bool):
            raise ValueError(f"MaskedCrossEntropy.compiled must be a bool, got {compiled!r}")
        self.fp32_upcast = fp32_upcast
        self.ignore_index = ignore_index
        self.reduction: Reduction = reduction
        self.compiled = compiled

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor | None = None,
        num_label_tokens: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of ``logits`` ``[..., vocab]`` against ``labels`` ``[...]``.

        Args:
            logits: Unnormalised scores; a DTensor sharded on the vocabulary stays sharded (collective
                over its group), any other DTensor is gathered first.
            labels: Target ids, same leading shape as ``logits``.
            mask: Optional, same shape as ``labels``; positions where it is 0 are ignored.
            num_label_tokens: With ``reduction="sum"``, divide by this count (0 gives a zero loss that
                keeps the graph, so every rank still runs backward).

        Returns:
            A scalar (``"sum"``/``"mean"``) or a tensor shaped like ``labels`` (``"none"``).

        Raises:
            ValueError: Shapes that do not match, or ``num_label_tokens`` without ``reduction="sum"``.
        """
        vocab_parallel = vocab_shard(logits) is not None
        if not vocab_parallel and hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"MaskedCrossEntropy: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} "
                "(expected logits [..., vocab] and labels [...])"
            )
        if mask is not None:
            if mask.shape != labels.shape:
                raise ValueError(
                    f"MaskedCrossEntropy: mask {tuple(mask.shape)} does not match labels "
                    f"{tuple(labels.shape)}"
                )
            labels = labels.masked_fill(mask == 0, self.ignore_index)
        reduce = "none" if self.reduction == "none" else "sum"
        if vocab_parallel:
            if self.compiled:
                _warn_vocab_parallel_not_compiled()
            if self.fp32_upcast:
                logits = logits.float()
            flat = vocab_parallel_cross_entropy(logits, labels, self.ignore_index).reshape(-1)
            flat = flat if self.reduction == "none" else flat.sum()
        else:
            token_losses = _compiled_token_losses() if self.compiled else _token_losses
            flat = token_losses(logits, labels, self.ignore_index, reduce, self.fp32_upcast)
        if self.reduction == "none":
            if num_label_tokens is not None:
                raise ValueError("MaskedCrossEntropy: num_label_tokens needs reduction='sum'")
            return flat.reshape(labels.shape)
        if self.reduction == "mean":
            if num_label_tokens is not None:
                raise ValueError("MaskedCrossEntropy: num_label_tokens needs reduction='sum'")
            count = (labels != self.ignore_index).sum()
            return flat / count.clamp(min=1)
        if num_label_tokens is None:
            return flat
        if int(num_label_tokens) == 0:
            return flat * 0.0
        return flat / num_label_tokens


def _token_losses(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str, upcast: bool
) -> torch.Tensor:
    """Cross entropy of plain ``logits [..., vocab]`` (upcast to fp32 first when ``upcast``)."""
    logits = logits.float() if upcast else logits
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction)


@functools.cache
def _compiled_token_losses() -> Any:
    """`_token_losses` under ``torch.compile``, made once per process (compiled at its first call)."""
    return torch.compile(_token_losses)


@functools.cache
def _warn_vocab_parallel_not_compiled() -> None:
    warnings.warn(
        "MaskedCrossEntropy(compiled=True): vocabulary-parallel logits (a tensor-parallel LM head) keep "
        "their sharded eager loss, which already holds 1/tp of the logits per rank; the compiled loss "
        "applies to unsharded logits",
        stacklevel=3,
    )
