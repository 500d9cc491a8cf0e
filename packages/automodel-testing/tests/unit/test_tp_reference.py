"""`automodel_testing.tp_reference`: a linear split as tensor parallelism splits it rounds as TP rounds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from automodel_testing.tp_reference import _split_forward


def test_row_split_adds_rounded_partials_and_column_split_concatenates() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    row = torch.nn.Linear(64, 8, dtype=torch.bfloat16)
    whole = row(x)
    _split_forward(row, dim=1, parts=2)
    w = row.weight
    partials = F.linear(x[:, :32], w[:, :32]) + F.linear(x[:, 32:], w[:, 32:])
    assert torch.equal(row(x), partials + row.bias)
    assert not torch.equal(row(x), whole)  # the extra rounding is what the split reproduces
    column = torch.nn.Linear(64, 8, dtype=torch.bfloat16)
    expected = column(x)
    _split_forward(column, dim=0, parts=2)
    assert torch.equal(column(x), expected)  # each output feature is one full matmul either way
    # Backward through the column split adds the slices' input gradients, as TP's all-reduce does.
    x.requires_grad_(True)
    column(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
