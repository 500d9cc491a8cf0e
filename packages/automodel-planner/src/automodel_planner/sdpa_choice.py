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

A job whose attention runs a fused kernel only a GPU has (``flash_attention_2`` and ``_3``,
``flex_attention``, a hub kernel) is profiled through `FUSED_ATTENTION`, an attention function
registered with transformers' own interface: SDPA's fused kernel with the call's causal flag and no
mask, as those kernels take it (the same FLOPs and saved tensors: query, key, value, output,
log-sum-exp), with the layer's sliding window, which they honour by skipping the tiles outside it,
told to the FLOP count (`current_window`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "FUSED_ATTENTION",
    "CudaSdpaChoice",
    "current_window",
    "profiled_attention",
    "runs_on_gpu_only",
    "unpacked_rows",
]

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


FUSED_ATTENTION = "automodel_planner_fused"
"""The attention implementation a job's GPU-only fused kernel is profiled as (`profiled_attention`)."""
_WINDOW: contextvars.ContextVar[int | None] = contextvars.ContextVar("automodel_planner_window", default=None)


def current_window() -> int | None:
    """The sliding window of the `FUSED_ATTENTION` call in progress (None: none, or no such call)."""
    return _WINDOW.get()


def runs_on_gpu_only(implementation: str | None) -> bool:
    """flash-attn's kernels (``flash_attention_2`` on), FlexAttention's, and hub kernels (``org/repo``)."""
    name = implementation or ""
    return name.startswith("flash_attention_") or name == "flex_attention" or "/" in name


def profiled_attention(implementation: str | None, model_class: type | None = None) -> str | None:
    """The attention implementation the fake forward runs for a job's ``implementation``.

    For a kernel only a GPU runs (no CPU runs flash-attn's kernels or FlexAttention's backward):
    `FUSED_ATTENTION`, registered with transformers on first use, where ``model_class`` dispatches
    through transformers' attention interface; SDPA where it picks an attention class by name
    (Falcon's), the same FLOPs, or else its default. Any other implementation (SDPA, eager, None:
    transformers' default) is the job's own.

    Raises:
        ValueError: ``model_class`` does not support the kernel (transformers' own flag says so).
    """
    if implementation is None or not runs_on_gpu_only(implementation):
        return implementation
    if model_class is not None:
        flag = "_supports_flex_attn" if implementation == "flex_attention" else "_supports_flash_attn"
        if not getattr(model_class, flag, False):
            raise ValueError(
                f"{model_class.__name__} does not support {implementation!r} (transformers' {flag} is "
                "False): choose sdpa or eager"
            )
        if not getattr(model_class, "_supports_attention_backend", False):
            return "sdpa" if getattr(model_class, "_supports_sdpa", False) else None
    from transformers import AttentionInterface

    if FUSED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(FUSED_ATTENTION, _fused_attention)
    return FUSED_ATTENTION


def _fused_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A flash-attn or FlexAttention call as transformers makes it, run by SDPA's fused kernel.

    transformers builds no mask for an implementation its mask interface does not know, as for these
    kernels, which take the causal flag and the sliding window instead (rows are not packed in a
    plan); grouped key/value heads go to the kernel as they are. Softcapping and attention sinks,
    which some of these kernels apply, change no FLOP count or saved tensor. Mutates nothing.
    """
    del attention_mask  # None: transformers makes no mask for an implementation it has none for
    causal = query.shape[2] > 1 and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True)
    )
    window = kwargs.get("sliding_window")
    token = _WINDOW.set(window if causal and isinstance(window, int) and window > 0 else None)
    try:
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout,
            is_causal=causal,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    finally:
        _WINDOW.reset(token)
    return out.transpose(1, 2).contiguous(), None
