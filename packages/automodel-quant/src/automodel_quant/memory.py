"""Memory of quantized weights and FP8 training, for planners (``automodel_planner``): pure arithmetic.

- `quantized_weight_bytes`: a frozen base weight stored in 4 or 8 bits (bitsandbytes' NF4/FP4 or
  int8), with its per-block absmax scales (one fp32 per ``block_size`` values, or one byte plus a
  second-level fp32 per 256 blocks under double quantization).
- `fp8_transient_bytes`: what float8 training adds at its peak: torchao's ``Float8Linear`` keeps its
  saved activations in high precision and casts the input and the weight of the running layer to float8
  (one byte per value) for the matmul; the largest layer's casts bound it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["FP8Facts", "FP8Memory", "fp8_transient_bytes", "quantized_weight_bytes"]


def quantized_weight_bytes(numel: int, *, bits: int, block_size: int = 64, double_quant: bool = False) -> int:
    """Bytes of ``numel`` weights stored in ``bits`` (4 or 8) with blockwise absmax scales.

    Raises:
        ValueError: ``bits`` is not 4 or 8, or ``block_size`` is below 1.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    blocks = -(-numel // block_size)
    scales = blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks
    return numel * bits // 8 + scales


def fp8_transient_bytes(linear_shapes: Sequence[tuple[int, int]], tokens: int) -> int:
    """Peak extra bytes of float8 training: the largest layer's float8 weight plus its float8 input.

    Args:
        linear_shapes: ``(out_features, in_features)`` of each converted linear layer (local shards).
        tokens: Tokens per micro-batch on the rank.
    """
    if not linear_shapes:
        return 0
    return max(out * inp + tokens * inp for out, inp in linear_shapes)


class FP8Facts(Protocol):
    """What `FP8Memory` reads of a planner's per-rank facts (``automodel_planner.RankFacts``)."""

    linear_shapes: Sequence[tuple[int, int]]
    """``(out_features, in_features)`` of each converted linear layer (local shards)."""
    tokens: int


@dataclass(frozen=True)
class FP8Memory:
    """Float8 training's casts at their peak on a rank (a planner term; see `fp8_transient_bytes`)."""

    def memory(self, facts: FP8Facts) -> list[tuple[str, int, str]]:
        """The largest layer's float8 weight and input."""
        return [("FP8 casts", fp8_transient_bytes(facts.linear_shapes, facts.tokens), "")]

    def buffers(self, facts: FP8Facts) -> dict[str, int]:
        """No collective buffers of their own."""
        del facts
        return {}

    def collectives(self, facts: FP8Facts) -> list[Any]:
        """No collectives of their own."""
        del facts
        return []

    def traffic(self, facts: FP8Facts) -> float:
        """None beyond the model's ops (the time model prices their work there)."""
        del facts
        return 0.0
