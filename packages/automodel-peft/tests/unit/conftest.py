"""Shared fixtures: a batch for the tiny models, and non-zero LoRA B matrices."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    from automodel_testing import make_batch

    return make_batch(128, 2, 16, seed=1)


def _perturb(model: nn.Module, seed: int = 3, std: float = 0.05) -> None:
    """Give every adapter a non-zero B (and move A) so that adapters change the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                noise = torch.randn(param.shape, generator=generator) * std
                param.add_(noise.to(param.dtype))


@pytest.fixture
def perturb() -> object:
    """``perturb(model)``: non-zero adapters (test modules cannot import conftest)."""
    return _perturb
