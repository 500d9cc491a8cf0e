"""Document-masked attention for context parallelism: packed rows exact under ``cp_size > 1``.

Ring attention (torch's ``context_parallel``) is causal over whole rows and takes no mask, so it cannot
keep the documents of a packed row apart. For such rows `context_parallel_region` opens a *document
region* instead (`document_region`) and the model's attention runs `cp_document_attention_forward`,
registered with transformers' ``AttentionInterface`` under `CP_DOCUMENT_ATTENTION` (and its mask
function with ``AttentionMaskInterface``), so the model's own attention code calls it:

- this rank's queries stay local; keys and values are all-gathered over the ``cp`` group with
  ``torch.distributed.nn.functional.all_gather`` (autograd-aware: in backward each rank receives the
  sum over the ranks of the gradients of its own keys and values);
- SDPA (transformers' ``sdpa_attention_forward``: GQA, scaling and dropout as usual) runs the local
  queries against every key with a boolean mask built from the *full-sequence* ``position_ids``: same
  document (a document starts wherever the positions do not continue by one, transformers'
  ``find_packed_sequence_indices``) and causal in the original token order, read through the
  load-balanced layout of the chunks (rank ``r`` of ``n`` holds chunks ``r`` and ``2n-1-r``); a sliding
  window (the attention call's ``sliding_window``, else the module's or its config's) composes with it.

This is the exact path, not the fast one: per layer every rank holds all ``T`` keys and values, and the
mask is ``[batch, 1, T / cp, T]`` booleans per rank (O(T^2) over the group), built once per region.
Outside a document region the function is transformers' SDPA unchanged (under ring attention too).

Refused with ``ValueError`` inside a document region, before any collective: soft-capped attention
(``softcap``; transformers' SDPA refuses it anyway), an additive ``position_bias``, and attention whose
queries are not this rank's shard of the sequence (cross-attention).

The active region is a module global, not a context variable: the autograd engine runs CUDA backward
(where activation checkpointing recomputes the forward) on its own threads, which do not see the
forward thread's context variables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CP_DOCUMENT_ATTENTION",
    "attention_window",
    "cp_document_attention_forward",
    "document_ids",
    "document_region",
    "document_region_active",
    "register_cp_document_attention",
]

CP_DOCUMENT_ATTENTION = "automodel_cp_sdpa"
"""The ``attn_implementation`` name `apply_context_parallel` gives a model: SDPA, document-masked inside
a document region."""


def attention_window(module: nn.Module) -> int | None:
    """The sliding window of an attention module, or ``None``.

    Its own ``sliding_window`` attribute wins (``None`` on full-attention layers), else its config's.
    """
    owner: object = module if hasattr(module, "sliding_window") else getattr(module, "config", None)
    window = getattr(owner, "sliding_window", None)
    return window if isinstance(window, int) else None


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[batch, seq]`` document index of each token of packed rows, or ``None`` when no row restarts.

    Documents are delimited as transformers does for packed rows without a mask: wherever a position
    does not continue the previous one by one (``masking_utils.find_packed_sequence_indices``).
    """
    from transformers.masking_utils import find_packed_sequence_indices

    if position_ids.ndim != 2 or position_ids.shape[-1] < 2:
        return None
    return find_packed_sequence_indices(position_ids)


class _DocumentLayout:
    """The cp group and the masks of one document region (see the module docstring)."""

    def __init__(
        self, group: dist.ProcessGroup, order: torch.Tensor, rank: int, size: int, docs: torch.Tensor
    ) -> None:
        self.group = group
        self.local_len = order.numel() // size
        self.batch = docs.shape[0]
        order = order.to(docs.device)
        query_pos = order[rank * self.local_len : (rank + 1) * self.local_len]  # original index per query
        key_pos = order  # gathered keys come rank after rank: the load-balanced order
        same_doc = docs[:, query_pos, None] == docs[:, None, key_pos]  # [batch, T/cp, T]
        self._distance = query_pos[:, None] - key_pos[None, :]  # [T/cp, T]: >= 0 where causal
        self._masks: dict[int | None, torch.Tensor] = {None: (same_doc & (self._distance >= 0))[:, None]}

    def mask(self, window: int | None) -> torch.Tensor:
        """``[batch, 1, T/cp, T]``: True where a local query may attend to a gathered key."""
        if window is not None and window not in self._masks:
            # transformers' sliding_window_overlay: kv_idx > q_idx - window
            self._masks[window] = self._masks[None] & (self._distance < window)[None, None]
        return self._masks[window]


_ACTIVE: list[_DocumentLayout] = []  # the open document region (at most one)


def document_region_active() -> bool:
    """Whether a document region is open (`document_region`)."""
    return bool(_ACTIVE)


@contextlib.contextmanager
def document_region(
    group: dist.ProcessGroup, position_ids: torch.Tensor, order: torch.Tensor
) -> Iterator[None]:
    """Run `cp_document_attention_forward` document-masked over ``group`` until the context closes.

    Preconditions: every rank of ``group`` enters with the same full ``position_ids``; the model's
    sequence tensors are this rank's shard in the load-balanced ``order`` (`load_balance_indices`).
    Mutates a module global (see the module docstring), restored on exit; forward and backward must run
    inside.

    Args:
        group: The ``cp`` process group.
        position_ids: ``[batch, seq]`` positions of the *full* rows (restarting per document).
        order: The load-balanced order of the sequence (`load_balance_indices`).

    Raises:
        RuntimeError: A document region is already open.
    """
    if _ACTIVE:
        raise RuntimeError("document regions of context parallelism cannot be nested")
    docs = document_ids(position_ids)
    if docs is None:
        docs = torch.zeros_like(position_ids)
    layout = _DocumentLayout(group, order, dist.get_rank(group), dist.get_world_size(group), docs)
    _ACTIVE.append(layout)
    try:
        yield
    finally:
        _ACTIVE.clear()


def _gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous(), group=group), dim=2)


def cp_document_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA attention; inside a document region, local queries against gathered, document-masked keys.

    Outside a region this is transformers' ``sdpa_attention_forward`` unchanged.

    Args:
        module: The attention module (for GQA, its window and causality).
        query: ``[batch, heads, T/cp, head_dim]`` (this rank's shard).
        key: ``[batch, kv_heads, T/cp, head_dim]``.
        value: ``[batch, kv_heads, T/cp, head_dim]``.
        attention_mask: The model's mask; ignored inside a document region (it was built from the local,
            non-contiguous positions).
        **kwargs: Passed on to ``sdpa_attention_forward`` (``dropout``, ``scaling``, ...).

    Returns:
        ``(output [batch, T/cp, heads, head_dim], None)``.

    Collectives: inside a document region, two all-gathers over the ``cp`` group (keys and values) in
    forward and their reduce in backward.

    Raises:
        ValueError: Inside a document region: soft-capped attention, a ``position_bias``, or queries that
            are not this rank's shard of the rows.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _ACTIVE:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layout = _ACTIVE[0]
    name = type(module).__name__
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"{name} soft-caps its attention scores (softcap={kwargs['softcap']}), which the SDPA of packed "
            "rows under context parallelism does not support; use data.packing: padded or cp_size: 1"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"{name} adds a position_bias to its attention scores, computed over this rank's keys only; "
            "packed rows under context parallelism cannot use it, use cp_size: 1"
        )
    local = query.shape[2] == key.shape[2] == layout.local_len
    if layout.batch not in (1, query.shape[0]) or not local:
        raise ValueError(
            f"{name} attends with queries {tuple(query.shape)} and keys {tuple(key.shape)}, but the packed "
            f"rows under context parallelism give each rank {layout.batch} row(s) of {layout.local_len} "
            "positions; only self-attention over the sharded rows is supported"
        )
    window = kwargs.pop("sliding_window") if "sliding_window" in kwargs else attention_window(module)
    kwargs.pop("is_causal", None)
    key = _gather_sequence(key, layout.group)
    value = _gather_sequence(value, layout.group)
    return sdpa_attention_forward(
        module, query, key, value, layout.mask(window if isinstance(window, int) else None),
        is_causal=False, **kwargs,
    )  # fmt: skip


def register_cp_document_attention() -> None:
    """Register `CP_DOCUMENT_ATTENTION` with transformers (attention and mask functions). Idempotent.

    The mask function is transformers' own SDPA mask, so outside a document region the model builds and
    uses exactly the masks of ``attn_implementation="sdpa"``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CP_DOCUMENT_ATTENTION, cp_document_attention_forward)
    AttentionMaskInterface.register(CP_DOCUMENT_ATTENTION, sdpa_mask)
