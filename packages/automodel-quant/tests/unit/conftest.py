"""Shared tiny models for the unit tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class ToyLM(nn.Module):
    """Linears of chosen sizes plus an ``lm_head``: a stand-in where a transformers model is overkill."""

    def __init__(self, sizes: list[tuple[int, int]], *, bias: bool = False, vocab: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(k, n, bias=bias) for k, n in sizes)
        self.lm_head = nn.Linear(sizes[-1][1], vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    from automodel_testing import make_batch

    return make_batch(128, 2, 16, seed=1)


@pytest.fixture
def toy_lm() -> type[ToyLM]:
    """The `ToyLM` class (test modules cannot import conftest under --import-mode=importlib)."""
    return ToyLM
