"""All-to-all (Ulysses) attention for context parallelism: exchange heads, attend over whole rows.

Each of the ``n`` ranks of the ``cp`` group holds ``T / n`` positions of every row (the load-balanced
layout, `automodel_distributed.context_parallel.load_balance_indices`) for all heads. One all-to-all
per query, key and value turns that into all ``T`` positions for ``heads / n`` of the heads; attention
then runs locally over whole rows, in the original token order; a last all-to-all turns the output
back into this rank's positions for all heads. Per layer each rank sends and receives about three times
its share of queries, keys and values plus its output, whatever the ring size would have been: the
exchange suits GPUs of one node (NVLink), where ring attention's ``n - 1`` steps are latency-bound.

Attention over whole rows needs no ring and no mask for unpacked rows: causal SDPA (flash kernels on
GPUs, the fused kernel on CPU), memory linear in ``T``. Packed rows run causal SDPA per document (the
documents' spans come from the full rows' ``position_ids``), so no ``T x T`` mask is ever built either;
a sliding window adds a mask of the document's (or row's) length where the window is shorter.

Needs the query heads divisible by ``n``. Key/value heads divisible by ``n`` keep grouped-query
attention as it is (each rank takes its heads' groups); otherwise each rank receives, per query head,
a copy of its key/value head (the key/value heads are repeated before the exchange).

The exchanges are ``torch.distributed.nn.functional.all_to_all_single`` (autograd-aware: backward runs
the inverse exchange of the gradients).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["all_to_all_attention", "heads_divisible"]


def heads_divisible(query: torch.Tensor, size: int) -> bool:
    """Whether all-to-all attention over ``size`` ranks can split the query heads of ``query``."""
    return query.shape[1] % size == 0


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int, natural: torch.Tensor) -> torch.Tensor:
    """``[B, h, T/n, D]`` (this rank's positions) -> ``[B, h/n, T, D]`` (its heads), original order."""
    from torch.distributed.nn.functional import all_to_all_single

    batch, heads, local, dim = x.shape
    chunks = x.reshape(batch, size, heads // size, local, dim).transpose(0, 1).contiguous()
    received = all_to_all_single(torch.empty_like(chunks), chunks, group=group)  # [n src, B, h/n, t, D]
    rows = received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * local, dim)
    return rows.index_select(2, natural)


def _to_sequence(y: torch.Tensor, group: dist.ProcessGroup, size: int, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `_to_heads`: ``[B, h/n, T, D]`` -> ``[B, h, T/n, D]``."""
    from torch.distributed.nn.functional import all_to_all_single

    batch, heads, length, dim = y.shape
    balanced = y.index_select(2, order).reshape(batch, heads, size, length // size, dim)
    chunks = balanced.permute(2, 0, 1, 3, 4).contiguous()  # [n dst, B, h/n, t, D]
    received = all_to_all_single(torch.empty_like(chunks), chunks, group=group)  # [n src heads, B, ...]
    return received.transpose(0, 1).reshape(batch, heads * size, length // size, dim)


class _OneGroup:
    """Stands for an attention module whose key/value heads were repeated to one per query head."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self.is_causal = getattr(module, "is_causal", True)


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Causal sliding-window mask ``[1, 1, L, L]`` (transformers' overlay), or None when it masks nothing."""
    if window is None or window >= length:
        return None
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return ((distance >= 0) & (distance < window))[None, None]


def _attend(
    owner: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: list[list[tuple[int, int]]] | None,
    window: int | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Causal SDPA over whole rows (``spans`` None) or per document; returns ``[B, h, T, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = _window_mask(q.shape[2], window, q.device)
        out, _ = sdpa_attention_forward(owner, q, k, v, mask, is_causal=mask is None, **kwargs)
        return out.transpose(1, 2)  # transformers returns [B, L, h, D]

    if spans is None:
        return sdpa(query, key, value)
    rows = []
    for b in range(query.shape[0]):
        row = spans[b] if len(spans) > 1 else spans[0]  # one row of positions serves every row
        pieces = [sdpa(*(t[b : b + 1, :, s:e] for t in (query, key, value))) for s, e in row]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def all_to_all_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    order: torch.Tensor,
    spans: list[list[tuple[int, int]]] | None,
    window: int | None,
    **kwargs: Any,
) -> torch.Tensor:
    """Attention of this rank's positions through an all-to-all over ``group`` (see the module docstring).

    Preconditions: every rank of ``group`` calls it for the same layer with the same shapes; the query
    heads are divisible by the group size (`heads_divisible`); ``query``/``key``/``value`` hold this
    rank's positions in the load-balanced ``order``.

    Args:
        module: The attention module (grouped-query ratio, causality).
        query: ``[B, heads, T/n, D]``.
        key: ``[B, kv_heads, T/n, D]``.
        value: ``[B, kv_heads, T/n, D]``.
        group: The ``cp`` process group.
        order: The load-balanced order of the rows (``T`` indices on the tensors' device).
        spans: Per row, the ``(start, end)`` of each document in original positions; None: whole rows.
        window: The sliding window of this layer, or None.
        **kwargs: ``sdpa_attention_forward``'s (``scaling``, ``dropout``, ...).

    Returns:
        ``[B, T/n, heads, D]``, as transformers' attention functions return.

    Collectives: four ``all_to_all_single`` over ``group`` in forward (query, key, value, output) and
    four in backward.
    """
    size = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    owner: Any = module
    if kv_heads % size:
        # Each rank needs the key/value head of each of its query heads: send one copy per query head.
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        owner = _OneGroup(module)
    natural = torch.argsort(order)
    q, k, v = (_to_heads(t, group, size, natural) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    out = _attend(owner, q, k, v, spans, window, kwargs)
    return _to_sequence(out, group, size, order).transpose(1, 2).contiguous()
