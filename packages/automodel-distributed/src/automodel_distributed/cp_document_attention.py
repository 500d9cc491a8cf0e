"""Attention for context parallelism without ring attention: packed rows, and all-to-all CP.

Ring attention (torch's ``context_parallel``) is causal over whole rows and takes no mask, so it cannot
keep the documents of a packed row apart. For such rows, and for all-to-all (Ulysses) context
parallelism, `context_parallel_region` opens a *document region* instead (`document_region`) and the
model's attention runs `cp_document_attention_forward`, registered with transformers'
``AttentionInterface`` under `CP_DOCUMENT_ATTENTION` (and its mask function with
``AttentionMaskInterface``), so the model's own attention code calls it. Per layer:

- **all-to-all** (the region's ``all_to_all``, when the ``cp`` size divides the layer's query heads):
  `automodel_distributed.cp_all_to_all` exchanges heads for positions, attends over whole rows (per
  document for packed rows) with causal SDPA and exchanges back. No mask over the row is ever built:
  memory linear in the row.
- **gathered keys** (otherwise, packed rows only): this rank's queries stay local; keys and values are
  all-gathered over the ``cp`` group with ``torch.distributed.nn.functional.all_gather``
  (autograd-aware), and SDPA runs against every key with a boolean mask built from the *full-sequence*
  ``position_ids``: same document (a document starts wherever the positions do not continue by one,
  transformers' ``find_packed_sequence_indices``) and causal in the original token order, read through
  the load-balanced layout of the chunks. Exact but quadratic: all ``T`` keys and values, and a
  ``[batch, 1, T / cp, T]`` boolean mask per rank.

A sliding window (the attention call's ``sliding_window``, else the module's or its config's) composes
with either. Outside a document region the function is transformers' SDPA unchanged (under ring
attention too).

Refused with ``ValueError`` inside a document region, before any collective: soft-capped attention
(``softcap``; transformers' SDPA refuses it anyway), an additive ``position_bias``, attention whose
queries are not this rank's shard of the sequence (cross-attention), and, for unpacked rows under
all-to-all CP, query heads that the ``cp`` size does not divide.

The active region is a module global, not a context variable: the autograd engine runs CUDA backward
(where activation checkpointing recomputes the forward) on its own threads, which do not see the
forward thread's context variables.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_distributed.cp_all_to_all import all_to_all_attention, heads_divisible

__all__ = [
    "CP_DOCUMENT_ATTENTION",
    "attention_window",
    "cp_document_attention_forward",
    "document_ids",
    "document_region",
    "document_region_active",
    "note_attention_module",
    "register_cp_document_attention",
]

CP_DOCUMENT_ATTENTION = "automodel_cp_sdpa"
"""The ``attn_implementation`` name `apply_context_parallel` gives a model: SDPA, document-masked inside
a document region."""


def attention_window(module: nn.Module) -> int | None:
    """The sliding window of an attention module, or ``None`` (full attention).

    Its own ``sliding_window`` attribute wins (``None`` on full-attention layers). A module without one
    reads its config: a layer that ``config.layer_types`` lists as ``full_attention`` (found by the
    module's ``layer_idx``) has none, and neither has a config with ``use_sliding_window: false``
    (transformers then sets ``sliding_window`` to 0 or leaves a default it does not apply); otherwise
    ``config.sliding_window`` when it is a positive int.
    """
    if hasattr(module, "sliding_window"):
        own: object = module.sliding_window
        return own if isinstance(own, int) and own > 0 else None
    config = getattr(module, "config", None)
    kinds, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(kinds, list | tuple) and isinstance(index, int) and index < len(kinds):
        if kinds[index] != "sliding_attention":
            return None
    elif getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


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
    """The cp group, the rows' layout and (lazily) the masks of one document region."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        order: torch.Tensor,
        rank: int,
        size: int,
        docs: torch.Tensor | None,
        *,
        all_to_all: bool = False,
        ring: int = 1,
    ) -> None:
        self.group = group
        self.size = size
        self.all_to_all = all_to_all
        self.ring = ring
        self.local_len = order.numel() // size
        self.docs = docs
        self.batch = docs.shape[0] if docs is not None else 1
        self.order = order if docs is None else order.to(docs.device)
        self._query_pos = self.order[rank * self.local_len : (rank + 1) * self.local_len]
        self._masks: dict[int | None, torch.Tensor] = {}
        self._spans: list[list[tuple[int, int]]] | None = None

    def spans(self) -> list[list[tuple[int, int]]] | None:
        """Per row, ``(start, end)`` of each document; None for unpacked rows (one host sync, once)."""
        if self.docs is None:
            return None
        if self._spans is None:
            self._spans = []
            for row in self.docs.tolist():
                starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
                self._spans.append(list(zip(starts, [*starts[1:], len(row)], strict=True)))
        return self._spans

    def mask(self, window: int | None) -> torch.Tensor:
        """``[batch, 1, T/cp, T]``: True where a local query may attend to a gathered key."""
        if window not in self._masks:
            device = self.order.device
            whole_rows = torch.zeros(1, self.order.numel(), dtype=torch.long, device=device)
            docs = (self.docs if self.docs is not None else whole_rows).to(device)
            same_doc = docs[:, self._query_pos, None] == docs[:, None, self.order]  # [batch, T/cp, T]
            distance = self._query_pos[:, None] - self.order[None, :]  # [T/cp, T]: >= 0 where causal
            allowed = same_doc & (distance >= 0)
            if window is not None:  # transformers' sliding_window_overlay: kv_idx > q_idx - window
                allowed = allowed & (distance < window)
            self._masks[window] = allowed[:, None]
        return self._masks[window]


_ACTIVE: list[_DocumentLayout] = []  # the open document region (at most one)


def document_region_active() -> bool:
    """Whether a document region is open (`document_region`)."""
    return bool(_ACTIVE)


@contextlib.contextmanager
def document_region(
    group: dist.ProcessGroup,
    position_ids: torch.Tensor | None,
    order: torch.Tensor,
    *,
    all_to_all: bool = False,
    ring: int = 1,
) -> Iterator[None]:
    """Run `cp_document_attention_forward` over ``group`` until the context closes.

    Preconditions: every rank of ``group`` enters with the same full ``position_ids``; the model's
    sequence tensors are this rank's shard in the load-balanced ``order`` (`load_balance_indices`).
    Mutates a module global (see the module docstring), restored on exit; forward and backward must run
    inside.

    Args:
        group: The ``cp`` process group.
        position_ids: ``[batch, seq]`` positions of the *full* rows (restarting per document, or not;
            None: unpacked rows).
        order: The load-balanced order of the sequence (`load_balance_indices`).
        all_to_all: Run the layers whose query heads the group divides as all-to-all attention
            (`automodel_distributed.cp_all_to_all`: no mask, memory linear in the row); the others
            gather keys and values and mask them.
        ring: The size of the ring attention the SDPA after the all-to-all runs as (torch's region over
            the groups), or 1; then ``order`` is the group's ring shard and sliding windows are refused.

    Raises:
        RuntimeError: A document region is already open.
    """
    if _ACTIVE:
        raise RuntimeError("document regions of context parallelism cannot be nested")
    layout = _DocumentLayout(
        group,
        order,
        dist.get_rank(group),
        dist.get_world_size(group),
        document_ids(position_ids) if position_ids is not None else None,
        all_to_all=all_to_all,
        ring=ring,
    )
    _ACTIVE.append(layout)
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _direct_sdpa(original)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        _ACTIVE.clear()


def _gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous(), group=group), dim=2)


_IN_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "automodel_cp_in_attention", default=False
)
"""Whether `cp_document_attention_forward` is running (its SDPA calls pass `_direct_sdpa` untouched)."""


_CALLER: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar(
    "automodel_cp_caller", default=None
)
"""The attention module whose forward is running (set by `apply_context_parallel`'s hooks)."""


def note_attention_module(module: nn.Module | None) -> None:
    """Record the attention module whose forward starts (``None``: it ended), for `_direct_sdpa`."""
    _CALLER.set(module)


class _DirectCaller(nn.Module):
    """Stands for an attention module that calls SDPA itself (its window, causality, the call's GQA ratio)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.sliding_window = attention_window(module)
        self.is_causal = getattr(module, "is_causal", True)
        self.name = type(module).__name__


def _direct_sdpa(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``scaled_dot_product_attention`` while a document region is open.

    A model that calls SDPA itself rather than through transformers' attention interface (Falcon, or a
    model switched back to ``sdpa``) would attend over its shard alone: the call, made inside an
    attention layer's forward (`note_attention_module`), runs as `cp_document_attention_forward` with
    that layer's window and causality instead. Calls from inside that function, and any call outside a
    region, go to ``original`` (torch's, or torch's ring attention when the region runs between
    all-to-all groups).
    """

    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **rest: Any,
    ) -> torch.Tensor:
        if _IN_ATTENTION.get() or not _ACTIVE:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **rest)
        module = _CALLER.get()
        problems = [
            text
            for text, bad in (
                ("outside the attention layers apply_context_parallel hooked", module is None),
                ("with a mask", attn_mask is not None),
                ("not causal", not is_causal),
            )
            if bad
        ]
        if problems:
            raise ValueError(
                f"the model calls scaled_dot_product_attention itself under context parallelism "
                f"({', '.join(problems)}); only causal calls without a mask from a hooked attention layer "
                "can run as the region's attention: use cp_size 1"
            )
        assert module is not None
        owner = _DirectCaller(module, query.shape[1] // key.shape[1])
        out, _ = cp_document_attention_forward(
            owner, query, key, value, None, dropout=dropout_p, scaling=scale
        )
        return out.transpose(1, 2)  # the function returns [B, T, h, D]; SDPA [B, h, T, D]

    return sdpa


def cp_document_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA attention; inside a document region, all-to-all or gathered, document-masked attention.

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

    Collectives: inside a document region, four all-to-alls over the ``cp`` group in forward and four
    in backward (all-to-all attention), or two all-gathers (keys and values) in forward and their reduce
    in backward.

    Raises:
        ValueError: Inside a document region: soft-capped attention, a ``position_bias``, queries that
            are not this rank's shard of the rows, or (unpacked rows, all-to-all) query heads the ``cp``
            size does not divide.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _ACTIVE:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    token = _IN_ATTENTION.set(True)  # its own SDPA calls are not a model's (see `_direct_sdpa`)
    try:
        return _region_attention(_ACTIVE[0], module, query, key, value, kwargs)
    finally:
        _IN_ATTENTION.reset(token)


def _region_attention(
    layout: _DocumentLayout,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """`cp_document_attention_forward` inside a region."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = module.name if isinstance(module, _DirectCaller) else type(module).__name__
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
    if layout.docs is not None and layout.batch not in (1, query.shape[0]):
        raise ValueError(
            f"{name} attends over {query.shape[0]} row(s), but the packed rows under context parallelism "
            f"are {layout.batch}: a forward must take every row of the region (a pipeline's microbatches "
            "cannot split packed rows under context parallelism; use unpacked rows or pp_size 1)"
        )
    if not local:
        raise ValueError(
            f"{name} attends with queries {tuple(query.shape)} and keys {tuple(key.shape)}, but the rows "
            f"under context parallelism give each rank {layout.local_len} positions; only self-attention "
            "over the sharded rows is supported"
        )
    window = kwargs.pop("sliding_window") if "sliding_window" in kwargs else attention_window(module)
    window = window if isinstance(window, int) else None
    if layout.ring > 1 and window is not None and window < layout.order.numel() * layout.ring:
        raise ValueError(
            f"{name} uses sliding-window attention (window {window}) over rows of "
            f"{layout.order.numel() * layout.ring} tokens, which ring attention between all-to-all groups "
            "cannot apply; use cp_ulysses_degree = cp_size (all-to-all attention) or shorter rows"
        )
    if layout.all_to_all and heads_divisible(query, layout.size):
        out = all_to_all_attention(
            module, query, key, value, group=layout.group, order=layout.order, spans=layout.spans(),
            window=window, **kwargs,
        )  # fmt: skip
        return out, None
    if layout.all_to_all and layout.docs is None:
        raise ValueError(
            f"{name} has {query.shape[1]} attention heads, which all-to-all context parallelism over "
            f"{layout.size} ranks cannot split; use a cp_ulysses_degree that divides the heads, or 1 (ring)"
        )
    kwargs.pop("is_causal", None)
    key = _gather_sequence(key, layout.group)
    value = _gather_sequence(value, layout.group)
    return sdpa_attention_forward(
        module, query, key, value, layout.mask(window),
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
