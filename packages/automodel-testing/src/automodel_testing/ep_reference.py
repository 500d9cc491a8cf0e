"""A single-process reference that combines routed experts as expert parallelism does.

Under expert parallelism transformers' ``AllToAllEP`` runs each (token, expert) pair alone, with a unit
routing weight, on the expert's rank, and combines on the sender: a token's ``K`` expert outputs, in its
top-k order, times the routing weights (in the dtype the router produced them: fp32 where transformers
keeps the router in fp32), summed at once and cast back. Single-process transformers lets the experts
module weigh and add them itself, which for some implementations (the eager loop) rounds the sum to the
activation dtype once per expert. In bf16 both are valid roundings of the same sum; near a routing
boundary their difference decides a later layer's top-k, an error of the combine order that a bound
drawn from transformers' own bf16 error does not allow for. `combine_like_expert_parallel` makes the
reference's routed experts modules combine exactly as the sharded model's do, so that the comparison is of
the sharding itself (the counterpart of `automodel_testing.tp_reference` for tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from automodel_testing.numerics import normalize_fqn

__all__ = ["combine_like_expert_parallel"]


def _slotwise(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        unit = torch.ones_like(top_k_index[:, :1], dtype=hidden_states.dtype)
        slots = [
            original(hidden_states, top_k_index[:, k : k + 1], unit) for k in range(top_k_index.shape[-1])
        ]
        combined = (torch.stack(slots, dim=1) * top_k_weights.unsqueeze(-1)).sum(dim=1)
        return combined.to(hidden_states.dtype)

    return forward


def combine_like_expert_parallel(reference: nn.Module, routed: Iterable[str]) -> list[str]:
    """Make the experts named ``routed`` in ``reference`` combine their outputs as ``AllToAllEP`` does.

    Args:
        reference: The single-process model (mutated: instance ``forward`` attributes; no collective).
        routed: Names (wrapper segments ignored) of the experts modules the sharded model runs through
            ``AllToAllEP`` (transformers' routed convention: ``experts(hidden, top_k_index, top_k_weights)``).

    Returns:
        The names of the modules changed.
    """
    by_name = {normalize_fqn(name): module for name, module in reference.named_modules()}
    changed = []
    for name in dict.fromkeys(normalize_fqn(n) for n in routed):
        module = by_name.get(name)
        if module is not None:
            module.forward = _slotwise(module.forward)
            changed.append(name)
    return changed
