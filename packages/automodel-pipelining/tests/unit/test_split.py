"""The split math: layers per stage, virtual stage counts, default FQN lists, explicit-split validation."""

from __future__ import annotations

import itertools

import pytest

from automodel_pipelining import (
    DecoderLayout,
    StageCosts,
    calculate_virtual_stages,
    generate_stage_fqns,
    read_stage_costs,
    resolve_decoder_layout,
    split_layers_by_cost,
    split_layers_evenly,
)
from automodel_pipelining.costs import matmul_elements
from automodel_pipelining.schedules import SCHEDULES
from automodel_pipelining.split import check_stage_fqns


def _layout(num_layers: int) -> DecoderLayout:
    return DecoderLayout(
        base="model",
        layers="model.layers",
        layer_names=tuple(str(i) for i in range(num_layers)),
        embed="model.embed_tokens",
        norm="model.norm",
        head="lm_head",
        shared=("model.rotary_emb",),
    )


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (10, 4, [3, 3, 2, 2]),
        (8, 4, [2, 2, 2, 2]),
        (5, 2, [3, 2]),
        (9, 8, [2, 1, 1, 1, 1, 1, 1, 1]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_remainder_goes_to_early_stages(layers: int, stages: int, expected: list[int]) -> None:
    assert split_layers_evenly(layers, stages) == expected


def test_cost_split_of_equal_layers_is_the_even_split() -> None:
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            assert split_layers_by_cost([1.0] * layers, stages) == split_layers_evenly(layers, stages)


def _largest_stage(counts: list[int], costs: list[float], first: float, last: float) -> float:
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    stage_costs = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    stage_costs[0] += first
    stage_costs[-1] += last
    return max(stage_costs)


@pytest.mark.parametrize(
    ("costs", "stages", "first", "last", "expected"),
    [
        # An LM head worth 2.4 layers (Llama-3-8B's 128k vocabulary against its layers): 5 | 3 + head.
        ([1.0] * 8, 2, 0.0, 2.4, [5, 3]),
        # 32 layers over 4 stages: no stage above 9, and the costs as close as they get (9, 9, 8, 8.4).
        ([1.0] * 32, 4, 0.0, 2.4, [9, 9, 8, 6]),
        # A heavy input side (a projection before the layers) moves layers off the first stage.
        ([1.0] * 6, 3, 1.5, 0.0, [1, 3, 2]),
        # Dense layers, then heavier ones: the cut follows the work, not the count.
        ([1.0, 1.0, 1.0, 8.0, 8.0, 8.0, 8.0, 8.0], 2, 0.0, 0.0, [5, 3]),
        # More work in the head than any split can hide: the last stage keeps one layer.
        ([1.0] * 4, 2, 0.0, 10.0, [3, 1]),
    ],
)
def test_cost_split_minimises_the_largest_stage(
    costs: list[float], stages: int, first: float, last: float, expected: list[int]
) -> None:
    counts = split_layers_by_cost(costs, stages, first_cost=first, last_cost=last)
    assert counts == expected
    # No split with one layer per stage or more does better (exhaustive over the cut points).
    best = min(
        _largest_stage([b - a for a, b in itertools.pairwise((0, *cuts, len(costs)))], costs, first, last)
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
    )
    assert _largest_stage(counts, costs, first, last) == pytest.approx(best)


def test_cost_split_errors() -> None:
    with pytest.raises(ValueError, match="between 1 and the number of layers"):
        split_layers_by_cost([1.0, 1.0], 3)
    with pytest.raises(ValueError, match="must not be negative"):
        split_layers_by_cost([1.0, 1.0], 2, last_cost=-1.0)


def test_stage_costs_from_a_model() -> None:
    """Costs are the matrix parameters outside embedding tables: the head counts, the embedding not."""
    from automodel_testing import build_tiny_model

    model = build_tiny_model("llama", seed=0, num_hidden_layers=6, vocab_size=2048)
    costs = read_stage_costs(model, resolve_decoder_layout(model))
    layer = model.model.layers[0]
    assert costs.layers == (matmul_elements(layer),) * 6
    assert matmul_elements(layer) == sum(p.numel() for p in layer.parameters() if p.ndim == 2)
    assert costs.first == 0  # the token embedding is a lookup
    assert costs.last == model.lm_head.weight.numel()  # the final norm is a vector
    assert costs.layer_counts(2) == [5, 1]
    assert costs == StageCosts(layers=costs.layers, first=0, last=2048 * 64)


def test_default_stage_counts() -> None:
    assert calculate_virtual_stages(num_layers=8, pp_size=4, schedule=SCHEDULES["1f1b"]) == 4
    assert calculate_virtual_stages(num_layers=8, pp_size=4, schedule=SCHEDULES["interleaved1f1b"]) == 8
    assert calculate_virtual_stages(num_layers=8, pp_size=2, schedule=SCHEDULES["zbvzerobubble"]) == 4


def test_layers_per_stage() -> None:
    looped = SCHEDULES["loopedbfs"]
    assert calculate_virtual_stages(num_layers=12, pp_size=2, schedule=looped, layers_per_stage=2) == 6
    assert (
        calculate_virtual_stages(num_layers=8, pp_size=4, schedule=SCHEDULES["gpipe"], layers_per_stage=2)
        == 4
    )
    # ceil(10 / 3) = 4 stages over 2 ranks
    assert calculate_virtual_stages(num_layers=10, pp_size=2, schedule=looped, layers_per_stage=3) == 4


def test_rounding_to_a_pp_multiple() -> None:
    looped = SCHEDULES["loopedbfs"]
    # ceil(10 / 2) = 5 stages over 2 ranks: up -> 6, down -> 4
    assert (
        calculate_virtual_stages(
            num_layers=10, pp_size=2, schedule=looped, layers_per_stage=2, round_to_pp_multiple="up"
        )
        == 6
    )
    assert (
        calculate_virtual_stages(
            num_layers=10, pp_size=2, schedule=looped, layers_per_stage=2, round_to_pp_multiple="down"
        )
        == 4
    )
    with pytest.raises(ValueError, match="5 stages, which is not a multiple of pp_size=2; set round_virtual"):
        calculate_virtual_stages(num_layers=10, pp_size=2, schedule=looped, layers_per_stage=2)


@pytest.mark.parametrize(
    ("schedule", "layers", "pp", "per_stage", "message"),
    [
        ("1f1b", 8, 2, 2, "runs one stage per rank"),
        ("interleaved1f1b", 8, 4, 2, "runs several stages per rank"),
        ("zbvzerobubble", 12, 2, 2, "needs exactly 2 stages per rank"),
    ],
)
def test_stage_count_errors(schedule: str, layers: int, pp: int, per_stage: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        calculate_virtual_stages(
            num_layers=layers, pp_size=pp, schedule=SCHEDULES[schedule], layers_per_stage=per_stage
        )


def test_more_stages_than_layers() -> None:
    with pytest.raises(
        ValueError, match=r"4 stages .* for 3 decoder layers: every stage needs at least one layer"
    ):
        calculate_virtual_stages(
            num_layers=3,
            pp_size=2,
            schedule=SCHEDULES["loopedbfs"],
            layers_per_stage=1,
            round_to_pp_multiple="up",
        )
    with pytest.raises(ValueError, match=r"8 stages .* for 6 decoder layers"):
        calculate_virtual_stages(num_layers=6, pp_size=4, schedule=SCHEDULES["interleaved1f1b"])


def test_default_fqns() -> None:
    parts = generate_stage_fqns(_layout(5), 3)
    assert parts == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.rotary_emb"],
        ["model.layers.2", "model.layers.3", "model.rotary_emb"],
        ["model.layers.4", "model.norm", "lm_head", "model.rotary_emb"],
    ]


def test_fqns_from_layer_counts() -> None:
    parts = generate_stage_fqns(_layout(4), 2, [3, 1])
    assert parts[0] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.rotary_emb",
    ]
    assert parts[1] == ["model.layers.3", "model.norm", "lm_head", "model.rotary_emb"]
    for bad in ([4, 0], [2, 1], [1, 1, 2]):
        with pytest.raises(ValueError, match="at least one layer"):
            generate_stage_fqns(_layout(4), 2, bad)


def test_first_stage_extras_and_single_stage() -> None:
    layout = DecoderLayout(
        base="model",
        layers="model.layers",
        layer_names=("0", "1"),
        embed="model.embed_tokens",
        norm="model.norm",
        head="lm_head",
        first_extras=("model.vision_tower",),
    )
    assert generate_stage_fqns(layout, 1) == [
        [
            "model.embed_tokens",
            "model.vision_tower",
            "model.layers.0",
            "model.layers.1",
            "model.norm",
            "lm_head",
        ]
    ]


def _check(parts: list[list[str]]) -> list[list[str]]:
    layout = _layout(2)
    modules = {"", "model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.1"}
    modules |= {"model.norm", "lm_head", "model.rotary_emb", "model.layers.1.mlp"}
    params = [
        "model.embed_tokens.weight",
        "model.layers.0.w",
        "model.layers.1.w",
        "model.norm.weight",
        "lm_head.weight",
    ]
    shared = {name: name == "model.rotary_emb" for name in modules}
    return check_stage_fqns(parts, layout=layout, module_names=modules, param_names=params, shared_ok=shared)


def test_explicit_split_accepted() -> None:
    parts = [
        ["model.embed_tokens", "model.layers.0", "model.rotary_emb"],
        ["model.layers.1", "model.norm", "lm_head", "model.rotary_emb"],
    ]
    assert _check(parts) == parts


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([["model.embed_tokens", "model.layers.9"], ["lm_head"]], r"does not have: \['model.layers.9'\]"),
        (
            [
                ["model.embed_tokens", "model.layers.0", "model.layers.1"],
                ["model.layers.1", "model.norm", "lm_head"],
            ],
            "model.layers.1.w is owned by stages 0 and 1",
        ),
        ([["model.embed_tokens", "model.layers.0"], ["model.norm", "lm_head"]], "owned by no stage"),
        (
            [["model.embed_tokens", "model.layers.1"], ["model.layers.0", "model.norm", "lm_head"]],
            "forward order",
        ),
        (
            [["model.layers.0"], ["model.embed_tokens", "model.layers.1", "model.norm", "lm_head"]],
            "must be on stage 0",
        ),
        (
            [["model.embed_tokens", "model.layers.0", "lm_head"], ["model.layers.1", "model.norm"]],
            "last stage",
        ),
        (
            [["model.embed_tokens", "model.layers.0", "model.layers.1.mlp"], ["model.layers.1", "lm_head"]],
            r"whole decoder layers .*\['model.layers.1.mlp'\]",
        ),
        ([["model.embed_tokens", "model.layers"], ["model.norm", "lm_head"]], "whole decoder layers"),
    ],
)
def test_explicit_split_errors(parts: list[list[str]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _check(parts)
