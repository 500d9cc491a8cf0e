"""A tied input embedding that adds its gradient rows into the shared weight's gradient in place.

When a model's input embedding and output head share one weight (``tie_word_embeddings``), autograd
sums the two uses' gradients before they reach the weight: the head's (a full ``vocab x hidden``
gradient, held from the start of backward) and the embedding's, which ``embedding_dense_backward``
also makes full size although only the rows of the batch's tokens are non-zero. The sum is a third
full-size tensor. For the tied 128k vocabulary of a Llama-3.2-1B shape in bf16 that is 3 x 0.5 GiB at
the end of backward, the step's peak on 4 CPU ranks (``benchmarks/bench_scale.py``).

`accumulate_tied_embedding_rows` makes the input embedding compute only the rows of the tokens it saw
(the same kernel on the batch's distinct ids) and add them into the weight's ``.grad`` right after the
head's gradient is accumulated there (``register_post_accumulate_grad_hook``). The values are those of
autograd's sum bit for bit (one addition per touched element, rounded once, as ``head + embedding``):
only a step whose weight has no gradient yet at forward takes this path; one that accumulates onto an
earlier micro-batch's gradient keeps autograd's order of additions and the plain embedding.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from automodel_modules import embedding_module

__all__ = ["accumulate_tied_embedding_rows", "tied_input_embedding"]


def tied_input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's input embedding when it is a plain ``nn.Embedding`` whose weight the output head shares.

    Read from the model's own structure (``get_input_embeddings`` / ``get_output_embeddings``); None for
    untied weights, a subclass with its own forward (a scaled embedding), or a model without both (a
    pipeline stage holds None for the parts it does not run).
    """
    embedding, head = embedding_module(model, "input"), embedding_module(model, "output")
    # A pipeline stage without the embedding or the head has None (or a stand-in) in its place.
    if not isinstance(embedding, nn.Embedding) or type(embedding).forward is not nn.Embedding.forward:
        return None
    if head is None or getattr(head, "weight", None) is not embedding.weight:
        return None
    return embedding


class _RowsIntoGrad(torch.autograd.Function):
    """``F.embedding`` whose weight gradient is added into ``weight.grad`` by a post-accumulate hook."""

    @staticmethod
    def forward(
        ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, by_freq: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.by_freq = weight, padding_idx, by_freq
        return F.embedding(ids, weight, padding_idx, None, 2.0, by_freq, False)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, None, None]:
        (ids,) = ctx.saved_tensors
        weight: nn.Parameter = ctx.weight
        flat = ids.reshape(-1)
        # The rows of the distinct ids, by the kernel autograd uses (same sums, same order per row).
        distinct, inverse = torch.unique(flat, return_inverse=True)
        padding = -1
        if ctx.padding_idx is not None:
            hit = (distinct == ctx.padding_idx).nonzero()
            padding = int(hit[0, 0]) if hit.numel() else -1
        rows = torch.ops.aten.embedding_dense_backward(
            grad_out.reshape(-1, grad_out.size(-1)), inverse, distinct.numel(), padding, ctx.by_freq
        )

        def add_rows(param: torch.Tensor) -> None:
            handle.remove()
            if param.grad is None:  # the head took no gradient in this backward: the rows alone
                param.grad = torch.zeros_like(param).index_add_(0, distinct, rows.to(param.dtype))
            else:
                param.grad.index_add_(0, distinct, rows.to(param.grad.dtype))

        # Runs once the head's gradient is in weight.grad (autograd accumulates it after this backward).
        handle = weight.register_post_accumulate_grad_hook(add_rows)
        return None, None, None, None


def _tied_forward(embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    weight = embedding.weight
    if (
        torch.is_grad_enabled()
        and weight.requires_grad
        and weight.grad is None
        and not isinstance(weight, DTensor)
        and embedding.max_norm is None
        and not embedding.sparse
    ):
        out: torch.Tensor = _RowsIntoGrad.apply(
            ids, weight, embedding.padding_idx, embedding.scale_grad_by_freq
        )
        return out
    return nn.Embedding.forward(embedding, ids)


def accumulate_tied_embedding_rows(model: nn.Module) -> bool:
    """Make the tied input embedding of ``model`` add its gradient rows in place (see the module docstring).

    Preconditions: gradients are reduced after the whole backward (FSDP2, or one process), not by hooks
    on the weight's gradient accumulation as DDP does. Mutates the embedding module (its ``forward``);
    returns False and changes nothing where `tied_input_embedding` finds none. The weight may be a
    DTensor (tensor parallelism) or already have a gradient at forward: that forward is the plain one.
    No collectives.
    """
    embedding = tied_input_embedding(model)
    if embedding is None:
        return False
    # A bound method, not a closure: a deep copy of the model binds it to the copied embedding.
    embedding.forward = types.MethodType(_tied_forward, embedding)  # type: ignore[method-assign]
    return True
