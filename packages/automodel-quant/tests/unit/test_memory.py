"""Bytes of quantized base weights and of FP8 casts."""

from __future__ import annotations

import pytest

from automodel_quant.memory import fp8_transient_bytes, quantized_weight_bytes


def test_quantized_weight_bytes() -> None:
    assert quantized_weight_bytes(4096, bits=4) == 2048 + 64 * 4  # one fp32 absmax per 64 values
    assert quantized_weight_bytes(4096 * 256, bits=4, double_quant=True) == 4096 * 128 + 16384 + 64 * 4
    assert quantized_weight_bytes(100, bits=8) == 100 + 2 * 4
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantized_weight_bytes(10, bits=3)


def test_fp8_transient_bytes_is_the_largest_layer() -> None:
    assert fp8_transient_bytes([(8, 4), (16, 4)], tokens=10) == 16 * 4 + 10 * 4
    assert fp8_transient_bytes([], tokens=10) == 0
