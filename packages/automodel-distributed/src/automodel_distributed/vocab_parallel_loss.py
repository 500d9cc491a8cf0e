"""Cross entropy on vocabulary-sharded logits, without gathering them (Megatron's vocab-parallel loss).

Under tensor parallelism the built-in plans leave the LM head's logits as a DTensor sharded on the
vocabulary (``Shard(-1)`` over ``tp``). Gathering them before the loss puts ``tokens x vocab`` values on
every rank (at 128k vocabulary and 128k tokens per micro-batch: 31 GiB in bf16, twice that as the fp32
copy, again as its gradient); torch's ``loss_parallel()`` keeps them sharded but needs the *backward*
inside its context too, which a pipeline schedule or a user's trainer does not give.
`vocab_parallel_cross_entropy` is an autograd function of the local shard: three all-reduces of one
value per token over the shard's group (the row maximum, the sum of exponentials, the target's logit)
and a backward that is local (softmax minus the target's one-hot, on the shard). Per rank it holds
``tokens x vocab / tp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from automodel_modules import is_dtensor

__all__ = ["vocab_parallel_cross_entropy", "vocab_shard"]


def vocab_shard(logits: torch.Tensor) -> tuple[Any, int] | None:
    """``(group, first vocabulary id of this rank's shard)`` when ``logits`` is sharded on its last dim only.

    A DTensor whose placements are ``Shard(last dim)`` on one mesh dimension and ``Replicate`` on the
    others qualifies; anything else (a plain tensor, ``Partial``, another sharded dim) gives None. The
    shard's start follows ``torch.chunk`` as DTensor shards: chunks of ``ceil(vocab / n)``.
    """
    if not is_dtensor(logits):  # without importing DTensor (seconds) for a single-process loss
        return None
    from torch.distributed.tensor import Shard

    last = logits.ndim - 1
    sharded = [i for i, p in enumerate(logits.placements) if p.is_shard()]
    others = [p for i, p in enumerate(logits.placements) if i not in sharded]
    if len(sharded) != 1 or not all(p.is_replicate() for p in others):
        return None
    placement = logits.placements[sharded[0]]
    if type(placement) is not Shard or placement.dim not in (-1, last):
        return None  # _StridedShard and friends interleave the vocabulary
    mesh_dim = sharded[0]
    count = logits.device_mesh.size(mesh_dim)
    chunk = -(-logits.shape[-1] // count)
    start = min(logits.device_mesh.get_local_rank(mesh_dim) * chunk, logits.shape[-1])
    return logits.device_mesh.get_group(mesh_dim), start


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, labels: torch.Tensor, start: int, ignore_index: int, group: Any
    ) -> torch.Tensor:
        width = local.shape[-1]
        peak = local.amax(dim=-1)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        softmax = (local - peak.unsqueeze(-1)).exp_()
        total = softmax.sum(dim=-1)
        dist.all_reduce(total, group=group)
        mine = (labels >= start) & (labels < start + width)
        index = (labels - start).clamp(0, max(width - 1, 0)).unsqueeze(-1)
        picked = local.gather(-1, index).squeeze(-1) if width else torch.zeros_like(peak)
        target = torch.where(mine, picked - peak, torch.zeros_like(peak))
        dist.all_reduce(target, group=group)
        valid = labels != ignore_index
        loss = torch.where(valid, total.log() - target, torch.zeros_like(total))
        softmax.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, index, hit, valid = ctx.saved_tensors
        scale = torch.where(valid, grad, torch.zeros_like(grad))
        grad_local = softmax * scale.unsqueeze(-1)  # a new tensor: a retained graph can run backward again
        if grad_local.shape[-1]:
            grad_local.scatter_add_(-1, index, -torch.where(hit, grad, torch.zeros_like(grad)).unsqueeze(-1))
        return grad_local, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-sharded ``logits`` ``[..., vocab]``, never gathered.

    Preconditions: `vocab_shard` accepts ``logits`` (a DTensor sharded on the last dim over one mesh
    dimension, replicated on the others); ``labels`` ``[...]`` holds global vocabulary ids and is the same
    on every rank of that dimension. Collective over the shard's group (three all-reduces of
    ``labels.numel()`` values forward, none backward); mutates nothing.

    Returns:
        A plain tensor shaped like ``labels`` (0 where the label is ``ignore_index``), the same on every
        rank of the group; the gradient reaches ``logits`` as a DTensor with their placements.
    """
    found = vocab_shard(logits)
    if found is None:
        raise ValueError(
            "vocab_parallel_cross_entropy: logits must be a DTensor sharded on the last dim only"
        )
    group, start = found
    local = logits.to_local()  # type: ignore[attr-defined]  # a DTensor (`vocab_shard`)
    flat = _VocabParallelCrossEntropy.apply(
        local.reshape(-1, local.shape[-1]), labels.reshape(-1), start, ignore_index, group
    )
    return flat.reshape(labels.shape)
