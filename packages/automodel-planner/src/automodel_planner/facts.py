"""`RankFacts`: what the terms of a pipeline rank's peak are computed from (one census of the model).

Where each parameter lives, how the strategy divides it and which FSDP unit gathers it is the
strategy's rule (`automodel_distributed.memory.placement_rule`); which blocks a pipeline rank runs is
the pipeline's (`automodel_pipelining.memory.rank_blocks`); the size of a quantized frozen weight is
automodel-quant's (`automodel_quant.memory.quantized_weight_bytes`). Nothing is allocated.

The census does not walk every parameter for every layout: the parameters are grouped once per model
by what their placement and their bytes depend on (`_ParamGroup`: the rule's `PlacementRule.key`, a
block's index included, and the parameter's dtype and trainability), and each layout places one
name per group. A 405B model's 1,137 parameters make 129 groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel_distributed.activation_checkpointing import (
    SELECTIVE_AC_ALWAYS_SAVE_OPS,
    resolve_checkpointing_mode,
)
from automodel_distributed.memory import (
    OuterUnits,
    Placement,
    PlacementKey,
    PlacementRule,
    always_resharded_units,
    decoder_block_indices,
    layer_index,
    outer_units,
    placement_rule,
    tp_replicated_parameters,
    tp_styled_modules,
)
from automodel_mesh import MeshLayout
from automodel_planner.inputs import PlanInput

__all__ = ["RankFacts", "decoder_blocks", "rank_facts", "tp_plan_key", "tp_styled"]

_FIRST_STAGE_PREFIX = "model.embed_tokens"  # outside the blocks: on the first stage, else on the last


@dataclass(frozen=True)
class _Cast:
    """The dtypes FSDP2's mixed precision moves a floating-point parameter in (None: as stored)."""

    gather: torch.dtype | None
    """``mp_policy.param_dtype``: the all-gather's and the unsharded parameter's."""
    reduce: torch.dtype | None
    """``mp_policy.reduce_dtype``: the reduce-scatter's."""
    float8: frozenset[str] = frozenset()
    """Parameters all-gathered in float8 (``FP8Config.enable_fsdp_float8_all_gather``): the weights of
    the linears FP8 training converts, which torchao casts before the all-gather; one byte each."""

    @classmethod
    def of(cls, plan: PlanInput) -> _Cast:
        policy = getattr(plan.strategy, "mp_policy", None)
        float8 = plan.model_fact(f"float8 {plan.fp8!r}", lambda: _float8(plan))
        return cls(getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None), float8)

    def sizes(self, name: str, param: nn.Parameter, local: float) -> tuple[float, float]:
        """``local`` bytes (as stored) of ``name`` in the all-gather dtype and in the reduce-scatter dtype."""
        if not param.is_floating_point():
            return local, local
        stored = param.element_size()
        gather = self.gather.itemsize if self.gather is not None else stored
        reduce = self.reduce.itemsize if self.reduce is not None else gather
        if name in self.float8:
            gather = torch.float8_e4m3fn.itemsize
        return local * gather / stored, local * reduce / stored


def _float8(plan: PlanInput) -> frozenset[str]:
    """The parameters FSDP2 all-gathers in float8 under ``plan.fp8`` (none without the setting)."""
    fp8 = plan.fp8
    if fp8 is None or not fp8.enabled or not fp8.enable_fsdp_float8_all_gather:
        return frozenset()
    from automodel_quant.fp8.plan import resolve_fp8_targets

    return frozenset(f"{fqn}.weight" for fqn in resolve_fp8_targets(plan.model, fp8).convert)


@dataclass
class _Tally:
    """Bytes of one pipeline rank's parameters, gradients, optimizer state and FSDP units."""

    params: float = 0.0
    grads: float = 0.0
    states: float = 0.0
    accumulated: float = 0.0
    accumulated_elements: float = 0.0
    units: dict[tuple[int, str], float] = field(default_factory=dict)
    unit_grads: dict[tuple[int, str], float] = field(default_factory=dict)
    unit_reduce: dict[tuple[int, str], float] = field(default_factory=dict)
    unit_axes: dict[tuple[int, str], str] = field(default_factory=dict)
    reduce_separate: bool = False

    def add(self, place: Placement, group: _ParamGroup, cast: _Cast) -> None:
        p_div, g_div, o_div = place.divisors
        param, size = group.param, group.size
        self.params += size / p_div
        if place.gathered:
            local = size / (place.shard / place.gathered_over)  # this rank's part, unsharded over FSDP
            gather, reduce = cast.sizes(group.name, param, local)
            self.units[place.unit] = self.units.get(place.unit, 0.0) + gather
            self.unit_axes[place.unit] = place.axis
            if param.requires_grad:
                self.unit_grads[place.unit] = self.unit_grads.get(place.unit, 0.0) + local
                self.unit_reduce[place.unit] = self.unit_reduce.get(place.unit, 0.0) + reduce
                self.reduce_separate = self.reduce_separate or reduce != gather
                self.accumulated += local
                self.accumulated_elements += local / param.element_size()
        if param.requires_grad:
            self.grads += group.stored / g_div
            # torch's AdamW keeps both moments in the parameter's dtype (zeros_like).
            self.states += group.stored * 2 / o_div


@dataclass(frozen=True)
class RankFacts:
    """One pipeline rank's facts (every rank's, without pipelining): what each planner term reads."""

    label: str
    """``pp rank 0``, or ``every rank``."""
    index: int
    layout: MeshLayout
    blocks: Sequence[int]
    """The transformer blocks the rank runs."""
    stage_blocks: Sequence[Sequence[int]]
    """The same, per pipeline stage the rank runs, in order (one list without pipelining)."""
    first_stage: bool
    last_stage: bool
    pipelined: bool
    n_micro: int
    """The pipeline's micro-batches per step (1 outside pipelining)."""
    accumulation: int
    """Forward/backward passes per optimizer step."""
    forward_runs: int
    """Times each block's forward runs per pass: 2 under full activation checkpointing (the recompute
    issues the block's collectives again), else 1 (selective checkpointing saves collectives' outputs:
    `SELECTIVE_AC_ALWAYS_SAVE_OPS`)."""
    gather_runs: int
    """Times each block's TP all-gathers run per pass: ``forward_runs``, or 2 under selective
    checkpointing whose saved ops lack the all-gather (`PlanInput.selective_save_ops`: torchtitan's):
    its output, the gathered input of the column-parallel matmuls, is then recomputed for their weight
    gradients, and the all-gather issued again in backward."""
    in_flight: float
    """Micro-batches whose activations of its blocks the rank holds at once."""
    tokens: int
    """Tokens per micro-batch on the rank."""
    rows: int
    """Sequences per micro-batch (``PlanInput.micro_batch_size``)."""
    sequence_shards: int
    """Slices the stream between blocks (and between pipeline stages) is cut in: ``tp`` under
    sequence parallelism, else 1."""
    element_size: int
    hidden_size: int
    attention: tuple[int, int]
    """(key/value heads the attention kernel receives, head dim)."""
    top_k: int
    """Experts each token is routed to (1 for dense models)."""
    params: float
    grads: float
    states: float
    accumulated: float
    accumulated_elements: float
    units: Sequence[int]
    """Each FSDP unit's parameters on the rank, unsharded, in the all-gather dtype (mixed precision's)."""
    unit_grads: Sequence[int]
    """Each unit's trainable parameters, unsharded, as stored."""
    unit_reduce: Sequence[int]
    """Each unit's reduce-scatter input: its trainable parameters in the reduction dtype."""
    unit_axes: Sequence[str]
    """Each unit's FSDP axis: ``dp_shard_cp``, or ``ep_shard`` for experts under expert parallelism."""
    reduce_separate: bool
    """The reduction dtype differs from the all-gather's: reduce-scatter inputs are buffers of their own."""
    units_freed: Sequence[bool]
    unit_names: Sequence[str]
    """Each unit's name (``block<i>``, ``block<i>.experts``, an outer unit's FQN, ``root``)."""
    linear_shapes: Sequence[tuple[int, int]]
    """Every block's linear weights as (out / tp, in), for float8 casts."""
    adapted_inputs: Sequence[int]
    """Input widths of the adapted layers in the rank's blocks."""


@dataclass
class _Census:
    tallies: list[_Tally]
    linear_shapes: list[tuple[int, int]] = field(default_factory=list)
    adapted_inputs: dict[int, list[int]] = field(default_factory=dict)


def _size(plan: PlanInput, param: nn.Parameter, index: int | None) -> float:
    """Bytes of a parameter as stored: a quantized frozen block weight under QLoRA, else its own."""
    bits = plan.base_weight_bits
    if bits is not None and not param.requires_grad and param.dim() == 2 and index is not None:
        from automodel_quant.memory import quantized_weight_bytes

        return float(quantized_weight_bytes(param.numel(), bits=bits))
    return float(param.numel() * param.element_size())


@dataclass
class _ParamGroup:
    """Parameters every layout places and sizes alike (their bytes summed)."""

    key: PlacementKey
    """Its members' `PlacementRule.key`."""
    name: str
    """One member's name: what the float8 casts read."""
    param: nn.Parameter
    """One member: its dtype and trainability are every member's."""
    first_stage: bool
    """Outside the blocks, on the first pipeline stage (the embedding) rather than the last."""
    size: float = 0.0
    """Bytes as stored (`_size`: a quantized frozen weight's)."""
    stored: float = 0.0
    """Bytes in the parameter's own dtype (what its gradient and AdamW moments take)."""


def _param_groups(plan: PlanInput, rule: PlacementRule, float8: frozenset[str]) -> list[_ParamGroup]:
    """The model's parameters grouped by `PlacementRule.key` and by what `_Tally.add` reads of each.

    A function of the model, the kept-whole towers, the QLoRA bits and the float8 parameters
    (``plan.fp8``'s; memoized under all four); the layout only places each group.
    """

    def groups() -> list[_ParamGroup]:
        grouped: dict[tuple[Any, ...], _ParamGroup] = {}
        for name, param in plan.model.named_parameters():
            key = rule.key(name)
            first = key[0] is None and name.startswith(_FIRST_STAGE_PREFIX)
            cast_key = (param.dtype, param.requires_grad, name in float8)
            group = grouped.setdefault((key, first, cast_key), _ParamGroup(key, name, param, first))
            group.size += _size(plan, param, key[0])
            group.stored += float(param.numel() * param.element_size())
        return list(grouped.values())

    # ``float8`` is a function of the model and ``plan.fp8`` (`_float8`).
    memo = f"param_groups {rule.whole!r} {hash(rule.tp_whole)} {plan.base_weight_bits} {plan.fp8!r}"
    return plan.model_fact(memo, groups)


def _block_linears(plan: PlanInput) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    """Every block's ``nn.Linear`` weights (out, in), and the input widths of each block's adapted layers.

    Linear layers only (what float8 converts): GPT-2's ``Conv1D`` stores its weight (in, out) and stays
    in bf16.
    """

    def walk() -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
        blocks = decoder_blocks(plan)
        shapes: list[tuple[int, int]] = []
        adapted: dict[int, list[int]] = {}
        for fqn, module in plan.model.named_modules():
            index = layer_index(f"{fqn}.weight", blocks) if isinstance(module, nn.Linear) else None
            if index is None:
                continue
            if "lora_" not in fqn:
                shapes.append((module.out_features, module.in_features))
            elif "lora_A" in fqn:
                adapted.setdefault(index, []).append(module.in_features)
        return shapes, adapted

    return plan.model_fact("block_linears", walk)


def _census(plan: PlanInput, owners: dict[int, int]) -> _Census:
    pp = plan.layout.pp
    rule = placement_rule(
        plan.strategy,
        plan.layout,
        plan.model,
        plan.dtype,
        outer=_outer(plan),
        blocks=decoder_blocks(plan),
        tp_whole=_tp_whole(plan),
    )
    cast = _Cast.of(plan)
    census = _Census([_Tally() for _ in range(pp)])
    for group in _param_groups(plan, rule, cast.float8):
        rank = 0
        if pp > 1:
            index = group.key[0]
            rank = owners.get(index, 0) if index is not None else 0 if group.first_stage else pp - 1
        census.tallies[rank].add(rule.of_key(group.key), group, cast)
    shapes, census.adapted_inputs = _block_linears(plan)
    tp = plan.layout.tp
    census.linear_shapes = plan.model_fact(
        f"linear_shapes {tp}", lambda: [(max(out // tp, 1), in_) for out, in_ in shapes]
    )
    return census


_ALL_GATHER_OP = "_c10d_functional.all_gather_into_tensor.default"


def _saves_all_gather(plan: PlanInput) -> bool:
    """Whether the job's selective checkpointing saves the all-gather's output (automodel's does)."""
    if plan.selective_save_ops is None:
        return _ALL_GATHER_OP in SELECTIVE_AC_ALWAYS_SAVE_OPS
    return _ALL_GATHER_OP in plan.selective_save_ops


def _owned_stages(plan: PlanInput, pipeline: Any) -> list[list[list[int]]]:
    """The blocks of each pipeline rank, per stage (one stage of all blocks without pipelining)."""
    layers = plan.config_int("num_hidden_layers")
    if pipeline is None:
        return [[list(range(layers))]]
    from automodel_pipelining.memory import rank_stage_blocks, stage_layer_counts

    counts = stage_layer_counts(plan.model, pipeline.config, layers, max(pipeline.stages, 1))
    return rank_stage_blocks(counts, plan.layout.pp)


def rank_facts(plan: PlanInput, *, pipeline: Any, tokens: int, profiled_blocks: int) -> list[RankFacts]:
    """The facts of every pipeline rank (one entry without pipelining).

    Args:
        plan: The job.
        pipeline: The pipeline's term (``automodel_pipelining.memory.PipelineMemory``) or None.
        tokens: Tokens per micro-batch on a rank (from the activation profile).
        profiled_blocks: Blocks the activation profile found (every rank's, without pipelining).
    """
    stages = _owned_stages(plan, pipeline)
    owned = [[b for stage in rank_stages for b in stage] for rank_stages in stages]
    census = _census(plan, {b: rank for rank, blocks in enumerate(owned) for b in blocks})
    freed = always_resharded_units(plan.model, _outer(plan))
    pp, hidden = plan.layout.pp, plan.config_int("hidden_size")
    heads = plan.config_int("num_attention_heads", default=1)
    attention = (
        plan.attention_kv_heads or plan.config_int("num_key_value_heads", "num_attention_heads"),
        plan.config_int("head_dim", default=hidden // max(heads, 1)),
    )
    n_micro = pipeline.config.n_microbatches if pipeline is not None else 1
    shards = plan.layout.tp if getattr(plan.strategy, "sequence_parallel", False) else 1
    mode = resolve_checkpointing_mode(plan.strategy.activation_checkpointing)
    runs = 2 if mode == "full" else 1
    facts = []
    for rank, tally in enumerate(census.tallies):
        blocks = owned[rank] if pp > 1 else list(range(profiled_blocks))
        stage_blocks = stages[rank] if pp > 1 else [blocks]
        keys = sorted(tally.units)
        facts.append(
            RankFacts(
                label=f"pp rank {rank}" if pp > 1 else "every rank",
                index=rank,
                layout=plan.layout,
                blocks=blocks,
                stage_blocks=stage_blocks,
                first_stage=rank == 0,
                last_stage=rank == pp - 1,
                pipelined=pipeline is not None,
                n_micro=n_micro,
                accumulation=n_micro if pipeline is not None else plan.accumulation,
                forward_runs=runs,
                gather_runs=2 if mode == "selective" and not _saves_all_gather(plan) else runs,
                in_flight=pipeline.in_flight(rank) if pipeline is not None else 1.0,
                tokens=tokens,
                rows=plan.micro_batch_size,
                sequence_shards=shards,
                element_size=plan.element_size,
                hidden_size=hidden,
                attention=attention,
                top_k=plan.config_int("num_experts_per_tok", "top_k", default=1),
                params=tally.params,
                grads=tally.grads,
                states=tally.states,
                accumulated=tally.accumulated,
                accumulated_elements=tally.accumulated_elements,
                units=[int(tally.units[k]) for k in keys],
                unit_grads=[int(tally.unit_grads.get(k, 0)) for k in keys],
                unit_reduce=[int(tally.unit_reduce.get(k, 0)) for k in keys],
                unit_axes=[tally.unit_axes[k] for k in keys],
                reduce_separate=tally.reduce_separate,
                units_freed=[k[1] in freed for k in keys],
                unit_names=[k[1] for k in keys],
                linear_shapes=census.linear_shapes,
                adapted_inputs=[w for b in blocks for w in census.adapted_inputs.get(b, [])],
            )
        )
    return facts


def _tp_whole(plan: PlanInput) -> frozenset[str]:
    """The parameters TP keeps whole (`tp_replicated_parameters`; none without TP, where it splits none)."""
    if plan.layout.tp == 1:
        return frozenset()
    return plan.model_fact(
        f"tp_whole {tp_plan_key(plan)}", lambda: tp_replicated_parameters(plan.model, tp_styled(plan))
    )


def tp_plan_key(plan: PlanInput) -> str:
    """What the TP plan of ``plan``'s model depends on beyond the model."""
    strategy, tp = plan.strategy, plan.layout.tp
    return f"{getattr(strategy, 'tp_plan', None)!r} {getattr(strategy, 'sequence_parallel', False)} {tp}"


def tp_styled(plan: PlanInput) -> Any:
    """`tp_styled_modules` of ``plan``'s model and strategy (memoized); None without a TP plan."""
    return plan.model_fact(
        f"tp styled {tp_plan_key(plan)}", lambda: tp_styled_modules(plan.model, plan.strategy, plan.layout.tp)
    )


def _outer(plan: PlanInput) -> OuterUnits:
    """The FSDP units outside the blocks of ``plan``'s model (a function of the model: memoized)."""
    return plan.model_fact("outer_units", lambda: outer_units(plan.model))


def decoder_blocks(plan: PlanInput) -> dict[str, int]:
    """The decoder blocks of ``plan``'s model by its structure (a function of the model: memoized)."""
    return plan.model_fact("decoder_blocks", lambda: decoder_block_indices(plan.model))
