"""Expert parallelism's share of a rank's memory and traffic, for planners (``automodel_planner``).

`ExpertMemory` is the planner term of the token exchange: the buffers an all-to-all sends and receives
(each token goes to ``top_k`` experts and comes back) and the bytes sent per step. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from automodel_mesh import Collective, Overlap

__all__ = ["ExpertFacts", "ExpertMemory"]


class ExpertFacts(Protocol):
    """What `ExpertMemory` reads of a planner's per-rank facts (``automodel_planner.RankFacts``)."""

    tokens: int
    """Tokens per micro-batch on the rank."""
    hidden_size: int
    element_size: int
    top_k: int
    """Experts each token is routed to."""
    blocks: Sequence[int]
    accumulation: int
    """Forward/backward passes per optimizer step."""
    forward_runs: int
    """Times each block's forward runs per pass (2 when full activation checkpointing recomputes it)."""


@dataclass(frozen=True)
class ExpertMemory:
    """The all-to-all of expert parallelism over ``ep_size`` ranks (a planner term)."""

    ep_size: int

    def memory(self, facts: ExpertFacts) -> list[tuple[str, int, str]]:
        """No lines of its own (the buffers are `buffers`)."""
        del facts
        return []

    def buffers(self, facts: ExpertFacts) -> dict[str, int]:
        """The routed tokens sent and received at once by one MoE layer."""
        return {
            "EP all-to-all send + receive": 2
            * facts.tokens
            * facts.top_k
            * facts.hidden_size
            * facts.element_size
        }

    def traffic(self, facts: ExpertFacts) -> float:
        """None beyond the model's ops."""
        del facts
        return 0.0

    def collectives(self, facts: ExpertFacts) -> list[Collective]:
        """Dispatch and combine, in each forward (a recompute's too) and backward, in every MoE layer."""
        ep, tokens = self.ep_size, facts.tokens
        exchanged = (
            (2 * facts.forward_runs + 2)
            * (ep - 1)
            / ep
            * tokens
            * facts.top_k
            * facts.hidden_size
            * facts.element_size
        )
        calls = len(facts.blocks) * facts.accumulation
        return [Collective("EP all-to-all", "ep", exchanged, calls, Overlap.EXPOSED, "all_to_all")]
