"""The split math: how many stages, and which module FQNs each stage owns. Pure functions, no torch.

- `calculate_virtual_stages`: the stage count from ``layers_per_stage``, its rounding and the schedule.
- `split_layers_evenly`: layer counts per stage, the remainder going to the early stages.
- `split_layers_by_cost`: layer counts per stage that make the most expensive stage as cheap as it can
  be, given each layer's cost and the cost of the first and last stages' other modules.
- `generate_stage_fqns`: the default split of a `DecoderLayout` (embeddings and first-stage extras on
  stage 0, final norm and LM head on the last stage, shared parameter-free modules on every stage).
- `check_stage_fqns`: validation of an explicit ``module_fqns_per_model_part``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from automodel_pipelining.layout import DecoderLayout
from automodel_pipelining.schedules import ScheduleSpec

__all__ = [
    "calculate_virtual_stages",
    "check_stage_fqns",
    "generate_stage_fqns",
    "split_layers_by_cost",
    "split_layers_evenly",
]


def split_layers_evenly(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: as even as possible, the remainder on the early stages (10 over 4: 3, 3, 2, 2)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def split_layers_by_cost(
    layer_costs: Sequence[float],
    num_stages: int,
    *,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
) -> list[int]:
    """Layers per stage, in order, so that the most expensive stage costs as little as possible.

    A stage's cost is the sum of its layers' costs, plus ``first_cost`` on the first stage (embeddings
    and what runs before the layers) and ``last_cost`` on the last (final norm, LM head). A pipeline
    runs at the pace of its slowest stage, so the split first makes the largest stage cost as small as
    it can be; among the splits that reach it, the one whose stage costs are closest to each other (the
    least sum of squares), and among those the one with the most layers on the early stages. With equal
    layer costs and no extra cost this is `split_layers_evenly`. Every stage gets at least one layer.

    Args:
        layer_costs: Cost of each decoder layer, in forward order (any unit, the same for all three).
        num_stages: Number of stages, at most ``len(layer_costs)``.
        first_cost: Cost of the first stage's modules besides its layers.
        last_cost: Cost of the last stage's modules besides its layers.

    Raises:
        ValueError: ``num_stages`` below 1 or above the number of layers, or a negative cost.
    """
    n = len(layer_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages must be between 1 and the number of layers ({n}), got {num_stages}")
    if min((*layer_costs, first_cost, last_cost)) < 0:
        raise ValueError("layer_costs, first_cost and last_cost must not be negative")
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def cost_of(stage: int, start: int, end: int) -> float:  # layers [start, end) on this stage
        extra = (first_cost if stage == 0 else 0.0) + (last_cost if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    def ends(stage: int, start: int) -> range:  # where this stage can end, leaving a layer per later one
        return range(start + 1, n - (num_stages - stage - 1) + 1)

    # Dynamic programs over (stage, first layer of the stage) for the stages from there on: the least
    # largest cost, then the least sum of squares with no stage above the overall least largest cost.
    inf = math.inf
    largest = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    largest[num_stages][n] = 0.0
    for stage in range(num_stages - 1, -1, -1):
        for start in range(stage, n - (num_stages - stage) + 1):
            largest[stage][start] = min(
                max(cost_of(stage, start, end), largest[stage + 1][end]) for end in ends(stage, start)
            )
    limit = largest[0][0] * (1 + 1e-9)  # sums in a different order differ in the last bits
    squares = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    squares[num_stages][n] = 0.0
    for stage in range(num_stages - 1, -1, -1):
        for start in range(stage, n - (num_stages - stage) + 1):
            squares[stage][start] = min(
                (
                    cost_of(stage, start, end) ** 2 + squares[stage + 1][end]
                    for end in ends(stage, start)
                    if cost_of(stage, start, end) <= limit
                ),
                default=inf,
            )
    counts: list[int] = []
    start = 0
    for stage in range(num_stages):
        target = squares[stage][start]
        tolerance = 1e-9 * max(target, 1.0)
        end = max(
            end
            for end in ends(stage, start)
            if cost_of(stage, start, end) <= limit
            and cost_of(stage, start, end) ** 2 + squares[stage + 1][end] <= target + tolerance
        )
        counts.append(end - start)
        start = end
    assert sum(counts) == n, counts
    return counts


def calculate_virtual_stages(
    *,
    num_layers: int,
    pp_size: int,
    schedule: ScheduleSpec,
    layers_per_stage: int | None = None,
    round_to_pp_multiple: Literal["up", "down"] | None = None,
) -> int:
    """Return the total number of pipeline stages (over all ranks).

    Without ``layers_per_stage``: ``pp_size * schedule.default_stages_per_rank``. With it:
    ``ceil(num_layers / layers_per_stage)``, rounded to a multiple of ``pp_size`` when
    ``round_to_pp_multiple`` says so. The result must fit the schedule: exactly one stage per rank for
    single-stage schedules, at least two for the others (exactly two for V schedules).

    Raises:
        ValueError: A count that is not a multiple of ``pp_size`` without rounding, a count the schedule
            cannot run, or more stages than layers. Messages name the fields to change.
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if layers_per_stage is None:
        num_stages = pp_size * schedule.default_stages_per_rank
        how = f"the {schedule.name!r} default of {schedule.default_stages_per_rank} stage(s) per rank"
    else:
        raw = math.ceil(num_layers / layers_per_stage)
        num_stages = raw
        if raw % pp_size:
            if round_to_pp_multiple == "up":
                num_stages = math.ceil(raw / pp_size) * pp_size
            elif round_to_pp_multiple == "down":
                num_stages = max(pp_size, raw // pp_size * pp_size)
            else:
                raise ValueError(
                    f"layers_per_stage={layers_per_stage} gives "
                    f"ceil({num_layers} / {layers_per_stage}) = {raw} "
                    f"stages, which is not a multiple of pp_size={pp_size}; set "
                    "round_virtual_stages_to_pp_multiple='up' or 'down', or change layers_per_stage"
                )
        how = f"layers_per_stage={layers_per_stage} ({raw} stages"
        how += f", rounded {round_to_pp_multiple} to {num_stages})" if num_stages != raw else ")"
    per_rank = num_stages // pp_size
    if not schedule.multi_stage and per_rank != 1:
        raise ValueError(
            f"schedule {schedule.name!r} runs one stage per rank, but {how} gives {per_rank} stages per "
            f"rank over pp_size={pp_size}; use a multi-stage schedule (e.g. 'interleaved_1f1b') or "
            f"layers_per_stage={math.ceil(num_layers / pp_size)}"
        )
    if schedule.multi_stage and per_rank < 2:
        raise ValueError(
            f"schedule {schedule.name!r} runs several stages per rank, but {how} gives {per_rank} per rank "
            f"over pp_size={pp_size}; lower layers_per_stage (at most {max(1, num_layers // (2 * pp_size))})"
        )
    if schedule.exact_stages_per_rank is not None and per_rank != schedule.exact_stages_per_rank:
        raise ValueError(
            f"schedule {schedule.name!r} needs exactly {schedule.exact_stages_per_rank} stages per rank, but "
            f"{how} gives {per_rank}; leave layers_per_stage unset"
        )
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages ({how}) for {num_layers} decoder layers: every stage needs at least one "
            "layer; use fewer stages or a model with more layers"
        )
    return num_stages


def generate_stage_fqns(
    layout: DecoderLayout, num_stages: int, layer_counts: Sequence[int] | None = None
) -> list[list[str]]:
    """The default split: module FQNs per stage, in stage order.

    Stage 0 gets the input embedding and the extras the model runs before its layers, the last stage the
    final norm, the extras run after the layers and the LM head, every stage the shared parameter-free
    modules (rotary embeddings), and the layers are spread with `split_layers_evenly`, or as
    ``layer_counts`` says (e.g. from `split_layers_by_cost`).

    Raises:
        ValueError: The layout has modules whose stage is unknown (`DecoderLayout.unplaced`), or
            ``layer_counts`` does not give each of the ``num_stages`` stages at least one of the layers.
    """
    if layout.unplaced:
        raise ValueError(
            f"cannot split automatically: the pipeline stage of {list(layout.unplaced)} is unknown "
            f"({layout.unplaced_reason}). Split it explicitly with module_fqns_per_model_part"
        )
    if layer_counts is None:
        layer_counts = split_layers_evenly(layout.num_layers, num_stages)
    counts = list(layer_counts)
    if len(counts) != num_stages or sum(counts) != layout.num_layers or min(counts) < 1:
        raise ValueError(
            f"layer_counts {counts} must give each of the {num_stages} stages at least one layer, "
            f"{layout.num_layers} layers in all"
        )
    layers = layout.layer_fqns
    parts: list[list[str]] = []
    start = 0
    for stage, count in enumerate(counts):
        fqns: list[str] = list(layout.first_stage_fqns) if stage == 0 else []
        fqns.extend(layers[start : start + count])
        start += count
        if stage == num_stages - 1:
            fqns.extend(layout.last_stage_fqns)
        fqns.extend(layout.shared)
        parts.append(fqns)
    return parts


def _covers(fqn: str, param: str) -> bool:
    return param == fqn or param.startswith(fqn + ".")


def check_stage_fqns(
    parts: Sequence[Sequence[str]],
    *,
    layout: DecoderLayout,
    module_names: set[str],
    param_names: Sequence[str],
    shared_ok: Mapping[str, bool],
) -> list[list[str]]:
    """Validate an explicit split against the model and return it as lists.

    Rules: every FQN names a module of the model; every parameter is owned by exactly one stage (a
    parameter-free module may appear on several); layers appear in forward order; the input embedding is
    on the first stage and the LM head on the last.

    Args:
        parts: One list of FQNs per stage.
        layout: The model's layout (for the order rules).
        module_names: FQNs of every module of the model.
        param_names: FQNs of every parameter of the model.
        shared_ok: FQN -> whether the module has no parameters (may be on several stages).

    Raises:
        ValueError: Naming the unknown FQNs, the parameters owned twice or by no stage, or the order problem.
    """
    unknown = sorted({f for part in parts for f in part if f not in module_names})
    if unknown:
        raise ValueError(f"module_fqns_per_model_part names modules the model does not have: {unknown}")
    inside_layers = sorted(
        {
            f
            for part in parts
            for f in part
            if f.startswith(layout.layers + ".") and f not in layout.layer_fqns
        }
    )
    if inside_layers or any(layout.layers in part for part in parts):
        raise ValueError(
            "module_fqns_per_model_part must list whole decoder layers (e.g. "
            f"{layout.layer_fqns[0] if layout.layer_fqns else layout.layers + '.0'!r}), not "
            f"{inside_layers or [layout.layers]}"
        )
    owner: dict[str, int] = {}
    problems: list[str] = []
    for stage, part in enumerate(parts):
        for fqn in part:
            if shared_ok.get(fqn, False):
                continue
            for param in param_names:
                if _covers(fqn, param):
                    previous = owner.setdefault(param, stage)
                    if previous != stage:
                        problems.append(f"{param} is owned by stages {previous} and {stage}")
    missing = [p for p in param_names if p not in owner]
    if missing:
        problems.append(f"parameters owned by no stage: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    layer_index = {fqn: i for i, fqn in enumerate(layout.layer_fqns)}
    order = [layer_index[f] for part in parts for f in part if f in layer_index]
    if order != sorted(order):
        problems.append(f"layers must appear in forward order across stages, got order {order}")
    last = len(parts) - 1
    if layout.embed is not None and any(layout.embed in part for part in parts[1:]):
        problems.append(f"the input embedding {layout.embed!r} must be on stage 0")
    if layout.head is not None and any(layout.head in part for part in parts[:last]):
        problems.append(f"the LM head {layout.head!r} must be on the last stage ({last})")
    if problems:
        raise ValueError("module_fqns_per_model_part is not a valid split: " + "; ".join(problems))
    return [list(part) for part in parts]
