"""Activations LoRA adapters add."""

from __future__ import annotations

from automodel_peft.memory import lora_activation_bytes, lora_traffic_bytes


def test_lora_activation_bytes() -> None:
    assert lora_activation_bytes([64, 64, 176], rank=8, tokens=10, element_size=4) == 3 * 10 * 8 * 4
    with_dropout = lora_activation_bytes([64, 176], rank=8, tokens=10, element_size=2, dropout=0.1)
    assert with_dropout == 2 * 10 * 8 * 2 + 10 * (64 + 176) * 2


def test_lora_traffic_bytes() -> None:
    """Forward: A reads the input, B's output is written, scaled and summed with the base's (6 passes);
    backward: 4 passes over the output gradient, 5 over input-sized tensors."""
    forward, backward = lora_traffic_bytes(100.0, 10.0)
    assert (forward, backward) == (100.0 + 60.0, 500.0 + 40.0)
