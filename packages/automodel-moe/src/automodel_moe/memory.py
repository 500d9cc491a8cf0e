"""Expert parallelism's share of a rank's memory and traffic, for planners (``automodel_planner``).

`ExpertMemory` is the planner term of the token exchange: the buffers an all-to-all sends and receives
(each token goes to ``top_k`` experts and comes back) and the bytes sent per step. `ExpertExchange`
says how the tokens travel: one copy per routed expert (``per_expert``: automodel's exchange,
transformers' ``AllToAllEP``) or one per destination rank, crossing the network once per destination
node (``per_rank``: DeepEP's dispatch and combine, which other frameworks run), and, for the latter,
how the router spreads a token's experts over the ranks. Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from automodel_mesh import Collective, Overlap

__all__ = ["ExpertExchange", "ExpertFacts", "ExpertMemory"]


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
class ExpertExchange:
    """How expert parallelism's dispatch and combine move a token (what `ExpertMemory` prices).

    Each of the ``ep`` ranks holds ``num_experts / ep`` consecutive experts (`automodel_moe.experts`
    shards them so; DeepEP's users too).
    """

    dispatch: Literal["per_expert", "per_rank"] = "per_expert"
    """``per_expert``: one copy of a token per routed expert, each straight to the expert's rank
    (automodel's exchange). ``per_rank``: one copy per destination rank, crossing the network once per
    destination node and forwarded over NVLink there (DeepEP)."""
    routing: Literal["uniform", "consecutive"] = "uniform"
    """Where a token's ``top_k`` experts lie (it matters to ``per_rank`` only): ``uniform``, any ``top_k``
    distinct experts alike (a trained router, balanced); ``consecutive``, experts ``t k`` to
    ``t k + k - 1`` (mod the expert count) for the ``t``-th token (NeMo AutoModel's ``FakeBalancedGate``,
    which its published MoE benchmarks run)."""
    num_experts: int = 0
    """The routed experts (``per_rank`` only)."""

    def __post_init__(self) -> None:
        if self.dispatch not in ("per_expert", "per_rank"):
            raise ValueError(f"ExpertExchange.dispatch={self.dispatch!r}: use 'per_expert' or 'per_rank'")
        if self.routing not in ("uniform", "consecutive"):
            raise ValueError(f"ExpertExchange.routing={self.routing!r}: use 'uniform' or 'consecutive'")
        if self.dispatch == "per_rank" and self.num_experts < 1:
            raise ValueError("ExpertExchange.num_experts must be the routed expert count under 'per_rank'")

    def destinations(self, top_k: int, ep: int, ranks_per_group: int = 1) -> float:
        """Expected distinct groups a token's experts lie in.

        A group is ``ranks_per_group`` consecutive ranks of the ``ep`` (the last may hold fewer).
        """
        experts = self.num_experts
        assert experts % ep == 0 and top_k <= experts, (experts, ep, top_k)
        per_group = experts // ep * ranks_per_group
        if self.routing == "uniform":  # per group: 1 - P(none of the top_k experts in it)
            sizes = [min(per_group, experts - start) for start in range(0, experts, per_group)]
            return sum(1.0 - math.comb(experts - size, top_k) / math.comb(experts, top_k) for size in sizes)
        period = experts // math.gcd(experts, top_k)  # the pattern repeats every `period` tokens
        reached = sum(
            len({(t * top_k + j) % experts // per_group for j in range(top_k)}) for t in range(period)
        )
        return reached / period

    def copies(self, top_k: int, ep: int) -> float:
        """Copies of a token sent to other ranks, expected (every rank alike a destination)."""
        if self.dispatch == "per_expert":
            return top_k * (ep - 1) / ep
        return self.destinations(top_k, ep) * (ep - 1) / ep


@dataclass(frozen=True)
class _NodeFanout:
    """`automodel_mesh.NodeFanout` of a ``per_rank`` exchange over ``ep`` ranks."""

    exchange: ExpertExchange
    top_k: int
    ep: int

    def network_share(self, ranks_per_node: int) -> float:
        """Copies to other nodes (once per node holding a destination) per copy to another rank."""
        nodes = -(-self.ep // max(ranks_per_node, 1))
        if nodes == 1:
            return 0.0
        remote = self.exchange.destinations(self.top_k, self.ep, ranks_per_node) * (nodes - 1) / nodes
        return remote / self.exchange.copies(self.top_k, self.ep)


@dataclass(frozen=True)
class ExpertMemory:
    """The all-to-all of expert parallelism over ``ep_size`` ranks (a planner term)."""

    ep_size: int
    exchange: ExpertExchange = ExpertExchange()
    """How the tokens travel (default: automodel's exchange, one copy per routed expert)."""

    def memory(self, facts: ExpertFacts) -> list[tuple[str, int, str]]:
        """No lines of its own (the buffers are `buffers`)."""
        del facts
        return []

    def buffers(self, facts: ExpertFacts) -> dict[str, int]:
        """The routed tokens sent and received at once by one MoE layer.

        One copy per routed expert, whatever the exchange (DeepEP's buffers are its own, sized by its
        configuration).
        """
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
        ep, exchange = self.ep_size, self.exchange
        row = facts.tokens * facts.hidden_size * facts.element_size
        exchanged = (2 * facts.forward_runs + 2) * exchange.copies(facts.top_k, ep) * row
        calls = len(facts.blocks) * facts.accumulation
        fanout = _NodeFanout(exchange, facts.top_k, ep) if exchange.dispatch == "per_rank" else None
        return [Collective("EP all-to-all", "ep", exchanged, calls, Overlap.EXPOSED, "all_to_all", fanout)]
