"""SDPA in a CPU fake forward as a GPU runs it: a fused kernel where the CPU would take its math path.

The planner profiles the model's own forward on fake CPU tensors (`automodel_planner.activations`).
``F.scaled_dot_product_attention`` picks its kernel by device: on CPU, its flash kernel needs one head
size for query, key and value and no dropout, and anything else takes the math path, which
materialises the ``s x s`` scores and probabilities in fp32 (and the causal mask) as ordinary matmuls
and softmax, and saves them for backward. A GPU runs such calls in a fused kernel: multi-head latent
attention's 192-wide query and key against 128-wide values (DeepSeek-V2/V3, MiniCPM3, Kimi and the
other MLA families) in the memory-efficient kernel, which takes a value head size of its own; attention
dropout (GPT-2's ``attn_pdrop``, StarCoder's, BioGPT's, in training) inside the flash or
memory-efficient kernel, both of which draw the dropout mask in-kernel. Profiled through the math path,
those models showed each block tens of GB of attention traffic and saved scores no GPU keeps: a planned
DeepSeek-V3 ran at 3% MFU, a GPT-2 of 7B at 15% where the published run of its widths reached 46%.

`CudaSdpaChoice`, a ``TorchFunctionMode`` active during the profile, sends such calls to
``aten._scaled_dot_product_efficient_attention`` (its meta kernel serves fake CPU tensors; CUDA's
flash kernel, where it is the one taken, does the same FLOPs and saves the same tensors), with SDPA's
own argument handling: grouped key/value heads repeated, a boolean mask turned into an additive bias,
the dropout probability passed on. The dispatch recorders then see one attention kernel, its FLOPs and
what it saves (query, key, value, output, log-sum-exp and the dropout's seed), as on the GPU. Calls the
CPU's flash kernel takes are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaSdpaChoice", "unpacked_rows"]

_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}


def _is_sdpa(func: Any) -> bool:
    return getattr(func, "__name__", None) == "scaled_dot_product_attention"


def _bound(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """SDPA's arguments by name (its signature: query, key, value, then the options)."""
    bound = dict(_DEFAULTS, enable_gqa=False)
    bound.update(zip(_PARAMETERS, args, strict=False))
    bound.update(kwargs)
    return bound


def _efficient_attention(call: dict[str, Any]) -> torch.Tensor:
    """``call`` (bound SDPA arguments) through the memory-efficient kernel, as SDPA's CUDA path runs it."""
    query, key, value, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    if call["enable_gqa"] and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    if mask is not None and mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        mask = bias.masked_fill(~mask, float("-inf"))
    if mask is not None:
        mask = mask.expand(*query.shape[:-1], key.shape[-2])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    outputs = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, mask, grad, call["dropout_p"], call["is_causal"], scale=call["scale"]
    )
    out: torch.Tensor = outputs[0]
    return out


class CudaSdpaChoice(TorchFunctionMode):
    """Run SDPA calls the CPU would compute by its math path in the GPU's memory-efficient kernel.

    Preconditions: the tensors are fake (or meta); a real CPU tensor has no memory-efficient kernel.
    Mutates nothing.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _is_sdpa(func):
            call = _bound(args, kwargs)
            # The CPU's flash kernel takes one head size and no dropout; CUDA's fused kernels take both.
            if call["query"].shape[-1] != call["value"].shape[-1] or call["dropout_p"] > 0:
                return _efficient_attention(call)
        return func(*args, **kwargs)


@contextlib.contextmanager
def unpacked_rows() -> Iterator[None]:
    """Tell transformers' mask builder that no row of the forward packs several sequences, as a GPU run sees.

    Without an attention mask, transformers looks for packed sequences in the position ids
    (``masking_utils.find_packed_sequence_indices``) and, finding none, passes SDPA no mask and
    ``is_causal=True``: the fused kernel, nothing ``s x s`` made or saved. It cannot read a fake tensor,
    so in a fake forward it assumes packing and builds the whole ``s x s`` mask, which SDPA turns into
    an additive bf16 mask in every block and saves for backward: 2 bytes per score of each block (8 GiB
    a block at 64k tokens) that no GPU run of the planner's rows (one sequence each) holds. Mutates
    transformers' ``masking_utils`` for the duration of the context only; a transformers without the
    lookup is left alone.
    """
    from transformers import masking_utils

    lookup = getattr(masking_utils, "find_packed_sequence_indices", None)
    if lookup is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = lookup
