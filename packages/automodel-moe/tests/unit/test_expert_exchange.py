"""`ExpertExchange`: the copies of a token each exchange sends, and how many cross the network."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from automodel_moe.memory import ExpertExchange, ExpertMemory


def _enumerated(experts: int, top_k: int, ep: int, ranks_per_group: int) -> float:
    """Distinct groups reached, averaged over every set of ``top_k`` distinct experts (uniform routing)."""
    per_group = experts // ep * ranks_per_group
    sets = list(itertools.combinations(range(experts), top_k))
    return sum(len({e // per_group for e in chosen}) for chosen in sets) / len(sets)


@pytest.mark.parametrize(
    ("experts", "top_k", "ep", "per_group"), [(8, 2, 4, 1), (12, 3, 4, 2), (12, 4, 6, 4)]
)
def test_uniform_routing_reaches_the_groups_every_expert_set_reaches_on_average(
    experts: int, top_k: int, ep: int, per_group: int
) -> None:
    exchange = ExpertExchange("per_rank", "uniform", experts)
    expected = _enumerated(experts, top_k, ep, per_group)
    assert exchange.destinations(top_k, ep, per_group) == pytest.approx(expected)


def test_the_fake_balanced_gate_sends_a_token_to_a_run_of_neighbouring_ranks() -> None:
    # Qwen3 30B-A3B on EP 8: a token's 8 consecutive experts are 8 of one rank's 16.
    qwen = ExpertExchange("per_rank", "consecutive", 128)
    assert qwen.destinations(8, 8) == 1.0
    assert qwen.copies(8, 8) == pytest.approx(7 / 8)
    # DeepSeek-V3 on EP 64 (4 experts a rank, 8 ranks a node): two ranks, always in one node.
    deepseek = ExpertExchange("per_rank", "consecutive", 256)
    assert deepseek.destinations(8, 64) == 2.0 and deepseek.destinations(8, 64, 8) == 1.0
    # Kimi K2 on EP 32 (12 experts a rank): runs starting at 0, 8 and 4 of a rank's 12 take 1, 2, 1.
    assert ExpertExchange("per_rank", "consecutive", 384).destinations(8, 32) == pytest.approx(4 / 3)
    # Automodel's exchange sends one copy per routed expert, whatever the router does.
    assert ExpertExchange().copies(8, 64) == pytest.approx(8 * 63 / 64)


def test_the_collective_carries_the_copies_and_the_network_share_of_its_exchange() -> None:
    facts = SimpleNamespace(
        tokens=4096, hidden_size=7168, element_size=2, top_k=8, blocks=[0, 1], accumulation=3, forward_runs=2
    )
    ours = ExpertMemory(64).collectives(facts)[0]
    deepep = ExpertMemory(64, ExpertExchange("per_rank", "consecutive", 256)).collectives(facts)[0]
    row = 4096 * 7168 * 2
    assert ours.bytes_per_call == pytest.approx(6 * 8 * 63 / 64 * row) and ours.node_fanout is None
    assert deepep.bytes_per_call == pytest.approx(6 * 2 * 63 / 64 * row) and deepep.calls == ours.calls == 6
    assert deepep.node_fanout is not None
    assert deepep.node_fanout.network_share(64) == 0.0, "one node: nothing crosses the network"
    # 8 ranks a node: one copy to the token's node, which is another node 7 times in 8.
    assert deepep.node_fanout.network_share(8) == pytest.approx((7 / 8) / (2 * 63 / 64))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"dispatch": "deepep"}, "ExpertExchange.dispatch='deepep'"),
        ({"routing": "random"}, "ExpertExchange.routing='random'"),
        ({"dispatch": "per_rank"}, "ExpertExchange.num_experts must be the routed expert count"),
    ],
)
def test_a_bad_exchange_is_refused_with_the_field(changes: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        ExpertExchange(**changes)
