"""Activation memory that LoRA adapters add, for planners (``automodel_planner``): pure arithmetic.

A LoRA layer ``y = W x + B(A(dropout(x))) * scale`` saves, beyond what the frozen base saves, the
rank-``r`` output of ``A`` (the input of ``B``), and with dropout the dropped copy of ``x`` (the input
of ``A``; without dropout ``A`` shares the base layer's saved input). The frozen base no longer needs
its weight gradient, but ``A`` needs the same input, so the base's saved input stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["LoRAFacts", "LoRAMemory", "lora_activation_bytes", "lora_traffic_bytes"]


def lora_traffic_bytes(input_bytes: float, output_bytes: float) -> tuple[float, float]:
    """Bytes a LoRA adapter moves beyond its frozen base layer, in forward and in backward.

    The adapter's matmuls are rank-``r`` thin (a few FLOPs per byte): their cost is the activations
    they read and write. Counted op by op over peft's ``result + lora_B(lora_A(x)) * scaling`` (no
    dropout), with ``I`` the layer's input bytes and ``O`` its output bytes on the rank:

    - forward: ``A`` reads the input (``I``); ``B`` writes an output-sized tensor, the scaling reads and
      writes it, the sum reads it and the base's output and writes the result (``6 O``);
    - backward (``A`` and ``B`` train, the base does not): the scaling's gradient reads and writes the
      output gradient (``2 O``), ``B``'s weight and input gradients each read it (``2 O``), ``A``'s
      weight gradient reads the input and its input gradient writes one (``2 I``), and autograd adds
      that to the base's input gradient (``3 I``).

    The ``r``-wide tensors are left out (``r`` is a few dozen against thousands).
    """
    return input_bytes + 6 * output_bytes, 5 * input_bytes + 4 * output_bytes


def lora_activation_bytes(
    in_features: Sequence[int], *, rank: int, tokens: int, element_size: int, dropout: float = 0.0
) -> int:
    """Bytes the adapters of the given layers save for backward, per micro-batch.

    Args:
        in_features: Input width of each adapted linear layer.
        rank: LoRA rank ``r``.
        tokens: Tokens per micro-batch on the rank.
        element_size: Bytes per activation value.
        dropout: LoRA dropout probability (a copy of each input is saved when above zero).
    """
    per_layer_rank = tokens * rank * element_size
    dropped = sum(tokens * width * element_size for width in in_features) if dropout > 0 else 0
    return len(in_features) * per_layer_rank + dropped


class LoRAFacts(Protocol):
    """What `LoRAMemory` reads of a planner's per-rank facts (``automodel_planner.RankFacts``)."""

    adapted_inputs: Sequence[int]
    """Input width of each adapted linear layer in the rank's blocks."""
    tokens: int
    element_size: int
    in_flight: float
    """Micro-batches whose activations the rank holds at once."""


@dataclass(frozen=True)
class LoRAMemory:
    """The adapters' saved activations on a rank (a planner term; see `lora_activation_bytes`)."""

    rank: int
    """LoRA rank ``r``."""
    dropout: float = 0.0

    def memory(self, facts: LoRAFacts) -> list[tuple[str, int, str]]:
        """One line, when the rank's blocks hold adapted layers."""
        if not facts.adapted_inputs:
            return []
        size = lora_activation_bytes(
            facts.adapted_inputs,
            rank=self.rank,
            tokens=facts.tokens,
            element_size=facts.element_size,
            dropout=self.dropout,
        )
        return [("LoRA activations", int(facts.in_flight * size), "")]

    def buffers(self, facts: LoRAFacts) -> dict[str, int]:
        """No collective buffers of their own."""
        del facts
        return {}

    def collectives(self, facts: LoRAFacts) -> list[Any]:
        """No collectives of their own."""
        del facts
        return []

    def traffic(self, facts: LoRAFacts) -> float:
        """None beyond the model's ops (the time model prices their work there)."""
        del facts
        return 0.0
