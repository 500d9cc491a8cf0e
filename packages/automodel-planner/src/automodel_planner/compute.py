"""The work of one forward, op by op, from the model's own forward on fake tensors.

`ComputeRecorder` is a dispatch mode that runs beside the activation recorder in the same fake forward
(`automodel_planner.activations.profile_step`). For every op it sees it adds, to the block running (or
to the rest of the model, block ``-1``):

- matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``, ...): ``2 x output elements x the
  contracted size`` FLOPs, under the module that ran them (so that the time model can tell a trainable
  weight's matmul, whose backward is twice its forward, from a frozen one's, whose backward computes the
  input gradient only), and the bytes of their first operand and output (what async TP's reductions
  read); apart, the FLOPs of those selective checkpointing recomputes (its policy,
  `automodel_distributed.activation_checkpointing.selective_checkpoint_policy`, as torchtitan's: every
  other matmul of a block call, the 2nd, 4th, ..., and any matmul op it neither counts nor saves);
- attention kernels (the ``scaled_dot_product`` family): ``2 b h s_q s_k (d + d_v)`` FLOPs, as torch's
  flop counter counts them (the whole score matrix), those of the calls made causal without a mask
  apart (a GPU's fused kernels skip their upper triangle; a call with a mask, a sliding window's, or
  a bidirectional one computes every score), and the ``b h s_q d_v`` elements of their output (what
  ring attention merges after each step);
- everything else that moves data (not views): the bytes of its tensor inputs and outputs, the traffic
  an eager kernel sends through HBM.

No process group, no mesh axes; the counts are one micro-batch on one rank before tensor parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from automodel_distributed.activation_checkpointing import (
    SELECTIVE_AC_ALWAYS_SAVE_OPS,
    SELECTIVE_AC_MATMUL_OPS,
)
from automodel_planner.sdpa_choice import current_window

__all__ = ["BlockCompute", "ComputeProfile", "ComputeRecorder", "SelectiveCount"]

_MATMULS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "_scaled_mm", "_scaled_grouped_mm"}
)
_FREE = frozenset({"detach", "lift_fresh", "alias", "empty", "empty_like", "empty_strided", "device"})


class SelectiveCount:
    """Which outputs selective checkpointing saves, op by op, as its policy counts them in a block call.

    `automodel_distributed.activation_checkpointing.selective_checkpoint_policy` (and torchtitan's):
    the ops it always saves (attention, float8's ``_scaled_mm``, collectives) and the 1st, 3rd, ... of
    the matmul ops it counts in one block call; every other op is recomputed (a ``_grouped_mm`` too).
    Mutates only its own count.
    """

    def __init__(self) -> None:
        self.matmuls = 0

    def start_block(self) -> None:
        """A block call starts: the matmul count starts again."""
        self.matmuls = 0

    def saves(self, op: str) -> bool:
        """Whether the op (``namespace.op.overload``) just run has its output saved."""
        if op in SELECTIVE_AC_ALWAYS_SAVE_OPS:
            return True
        if op not in SELECTIVE_AC_MATMUL_OPS:
            return False
        self.matmuls += 1
        return self.matmuls % 2 == 1


@dataclass
class BlockCompute:
    """What one transformer block (or the rest of the model) computes in one forward."""

    matmul_flops: dict[str, float] = field(default_factory=dict)
    """Module FQN (in the profiled model) -> forward matmul FLOPs of that module."""
    matmul_output_bytes: dict[str, float] = field(default_factory=dict)
    """Module FQN -> bytes of its matmuls' outputs (what a row-parallel layer's partial sums occupy)."""
    matmul_input_bytes: dict[str, float] = field(default_factory=dict)
    """Module FQN -> bytes of its matmuls' first operands (what a column-parallel layer's input
    gradient occupies)."""
    matmul_weight_bytes: dict[str, float] = field(default_factory=dict)
    """Module FQN -> bytes of its matmuls' second operands (a linear layer's weight)."""
    recomputed_matmul_flops: dict[str, float] = field(default_factory=dict)
    """Module FQN -> of its ``matmul_flops``, those selective checkpointing does not save (recomputes)."""
    attention_flops: float = 0.0
    """Forward FLOPs of the attention kernels, the whole score matrix counted."""
    causal_attention_flops: float = 0.0
    """Of ``attention_flops``, the calls made with ``is_causal`` and no mask: the whole matrix counted,
    of which a GPU's fused kernels compute the lower triangle only."""
    window_attention_flops: float = 0.0
    """Of ``causal_attention_flops``, the calls of a kernel that honours a sliding window narrower than
    their keys (flash-attn's, FlexAttention's: `automodel_planner.sdpa_choice.current_window`)."""
    window_band_flops: float = 0.0
    """What those calls compute: the band of scores inside each query's window."""
    attention_outputs: float = 0.0
    """Elements of the attention kernels' outputs (``b h s_q d``)."""
    memory_bytes: float = 0.0
    """Bytes every other (non-view) op reads and writes."""

    @property
    def matmul_total(self) -> float:
        """All matmul FLOPs of the block."""
        return sum(self.matmul_flops.values())


@dataclass(frozen=True)
class ComputeProfile:
    """One micro-batch's forward on one rank: per block, and outside the blocks (embedding, head, loss)."""

    blocks: tuple[BlockCompute, ...]
    outside: BlockCompute
    tokens: int
    """Tokens per micro-batch on one rank."""


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _matrices(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """A matmul's matrix operands, in order (``addmm``'s bias, a vector, is skipped)."""
    return [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]


def _first_matrix(args: tuple[Any, ...]) -> torch.Tensor | None:
    """A matmul's first matrix operand."""
    return next(iter(_matrices(args)), None)


def _matmul_flops(args: tuple[Any, ...], out: Any) -> float:
    """``2 x output elements x contracted size``: the contracted size is the last dim of the first matrix."""
    outputs = _tensors(out)
    first = _first_matrix(args)
    if not outputs or first is None:
        return 0.0
    return 2.0 * outputs[0].numel() * first.shape[-1]


def _attention_flops(args: tuple[Any, ...]) -> tuple[float, float]:
    """``2 b h s_q s_k (d + d_v)``: attention's two matmuls over the whole scores; ``b h s_q d_v`` outputs.

    Query ``[b, h, s_q, d]``, key ``[b, h_kv, s_k, d]`` and value ``[b, h_kv, s_k, d_v]`` are the op's
    first three tensors (``4 b h s_q s_k d`` where ``d_v == d``). torch's flop counter counts
    ``scaled_dot_product_attention`` so; counted here so that every torch version and every attention
    kernel's op count the same (older flop counters miss the CPU kernels).
    """
    query, key, value = [a for a in args if isinstance(a, torch.Tensor)][:3]
    batch, heads, s_q, head_dim = query.shape
    outputs = float(batch * heads * s_q * value.shape[-1])
    return 2.0 * batch * heads * s_q * key.shape[-2] * (head_dim + value.shape[-1]), outputs


def _band_share(queries: int, keys: int, window: int) -> float:
    """Of a causal self-attention's whole ``queries x keys`` scores, those within ``window`` of their query.

    The queries are the last ``queries`` of the ``keys`` positions; the one at position ``p`` sees
    ``min(p + 1, window)`` keys. The tiles a kernel computes whole at the band's edges are left out.
    """
    first, last = keys - queries + 1, min(window, keys)  # the keys seen, ``p + 1``, from first on
    inside = (first + last) * (last - first + 1) / 2 if first <= last else 0.0  # sum of p + 1 up to window
    capped = (keys - max(last, first - 1)) * window  # each later query sees the window only
    return (inside + capped) / (queries * keys)


def _causal(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether an attention kernel's call is causal without a mask (by its schema's argument names)."""
    names = [argument.name for argument in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | dict(kwargs)
    mask = bound.get("attn_mask", bound.get("attn_bias"))
    return bool(bound.get("is_causal", False)) and mask is None


class ComputeRecorder(TorchDispatchMode):
    """Counts FLOPs and bytes per block; ``where()`` says (block index or -1, innermost module FQN)."""

    def __init__(self, num_blocks: int, where: Callable[[], tuple[int, str]], parameters: set[int]) -> None:
        super().__init__()
        self.where = where
        self.parameters = parameters
        """Storages of the model's parameters: a weight an op reads by index (the embedding's table) or
        scales with (a norm's) is not activation traffic."""
        self.blocks = [BlockCompute() for _ in range(num_blocks)]
        self.outside = BlockCompute()
        self.selective = SelectiveCount()
        self._block = -1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _FREE or getattr(func, "is_view", False):
            return out
        block, fqn = self.where()
        target = self.blocks[block] if block >= 0 else self.outside
        if name in _MATMULS:
            flops = _matmul_flops(args, out)
            target.matmul_flops[fqn] = target.matmul_flops.get(fqn, 0.0) + flops
            if block != self._block:  # the forward calls each block once: a new index, a new call
                self._block = block
                self.selective.start_block()
            if not self.selective.saves(str(func)):
                target.recomputed_matmul_flops[fqn] = target.recomputed_matmul_flops.get(fqn, 0.0) + flops
            written = sum(t.numel() * t.element_size() for t in _tensors(out)[:1])
            target.matmul_output_bytes[fqn] = target.matmul_output_bytes.get(fqn, 0.0) + written
            read, weight = ([m.numel() * m.element_size() for m in _matrices(args)] + [0, 0])[:2]
            target.matmul_input_bytes[fqn] = target.matmul_input_bytes.get(fqn, 0.0) + read
            target.matmul_weight_bytes[fqn] = target.matmul_weight_bytes.get(fqn, 0.0) + weight
        elif "scaled_dot_product" in name:
            flops, outputs = _attention_flops(args)
            target.attention_flops += flops
            causal = _causal(func, args, kwargs)
            target.causal_attention_flops += flops if causal else 0.0
            window, query, key = current_window(), *_tensors(args)[:2]
            queries, keys = query.shape[-2], key.shape[-2]
            if causal and window is not None and window < keys:
                target.window_attention_flops += flops
                target.window_band_flops += flops * _band_share(queries, keys, window)
            target.attention_outputs += outputs
        else:
            target.memory_bytes += sum(
                t.numel() * t.element_size()
                for t in _tensors((args, kwargs, out))
                if t.untyped_storage()._cdata not in self.parameters
            )
        return out

    def profile(self, tokens: int, copies: Mapping[int, int] | None = None) -> ComputeProfile:
        """The counts as a profile; each block of ``copies`` (it did not run) takes its source's counts."""
        blocks = list(self.blocks)
        for index, source in (copies or {}).items():
            blocks[index] = dataclasses.replace(
                blocks[source],
                matmul_flops=dict(blocks[source].matmul_flops),
                matmul_output_bytes=dict(blocks[source].matmul_output_bytes),
                matmul_input_bytes=dict(blocks[source].matmul_input_bytes),
                matmul_weight_bytes=dict(blocks[source].matmul_weight_bytes),
                recomputed_matmul_flops=dict(blocks[source].recomputed_matmul_flops),
            )
        return ComputeProfile(blocks=tuple(blocks), outside=self.outside, tokens=tokens)
