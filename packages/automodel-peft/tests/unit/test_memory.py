"""Activations LoRA adapters add."""

from __future__ import annotations

from automodel_peft.memory import lora_activation_bytes


def test_lora_activation_bytes() -> None:
    assert lora_activation_bytes([64, 64, 176], rank=8, tokens=10, element_size=4) == 3 * 10 * 8 * 4
    with_dropout = lora_activation_bytes([64, 176], rank=8, tokens=10, element_size=2, dropout=0.1)
    assert with_dropout == 2 * 10 * 8 * 2 + 10 * (64 + 176) * 2
