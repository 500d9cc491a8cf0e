"""The strategy's share of a rank's memory and traffic, for planners (``automodel_planner``).

Pure arithmetic over a meta model and the layout's sizes; no process group, nothing mutated:

- `placement_rule`: how the strategy places each parameter: what it divides the parameter, its
  gradient and its AdamW state by on one rank, and which FSDP unit gathers it over how many ranks
  (the units `plan_fsdp_units` makes, experts on their own mesh, frozen towers kept whole); its
  `PlacementRule.key` tells which parameters every layout places alike;
- `fsdp_buffer_bytes` / `fsdp_comm_buffer_bytes`: FSDP2's gathered units and collective buffers;
- `StrategyMemory`: the planner term of the strategy, with tensor and context parallelism: parameters,
  gradients, optimizer state, the unreduced gradients of deferred reduction, the gathered units, the
  collective buffers and the traffic of each collective, from a rank's facts (`StrategyFacts`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

from automodel_distributed.activation_checkpointing import resolve_checkpointing_mode
from automodel_distributed.config import (
    DDPConfig,
    DistributedConfig,
    FSDP2Config,
    MegatronFSDPConfig,
    default_mp_policy,
)
from automodel_mesh import Collective, MeshLayout, Overlap

if TYPE_CHECKING:  # the TP styles import torch.distributed.tensor (sympy): only when TP is planned
    from automodel_distributed.tensor_parallel.traffic import PassCollectives, TPCollectives

__all__ = [
    "TP_BLOCK_COLLECTIVE",
    "OuterUnits",
    "Placement",
    "PlacementKey",
    "PlacementRule",
    "StageSync",
    "StrategyFacts",
    "StrategyMemory",
    "always_resharded_units",
    "decoder_block_indices",
    "fsdp_buffer_bytes",
    "fsdp_comm_buffer_bytes",
    "layer_index",
    "outer_units",
    "placement_rule",
    "reshard_setting",
    "tp_plan_collectives",
    "tp_replicated_parameters",
    "tp_styled_modules",
    "units_gathered_in_backward",
]

_ROOT = (0, "root")


@dataclass(frozen=True)
class Placement:
    """Where the strategy puts one parameter on a rank."""

    divisors: tuple[float, float, float]
    """What its bytes are divided by on one rank: the parameter, its gradient, its optimizer state."""
    shard: int
    """Ranks FSDP shards it over (1: every rank holds it whole)."""
    unit: tuple[int, str]
    """Its FSDP unit: (forward order, name)."""
    gathered_over: int
    """Ranks its unit gathers it over (1: never gathered)."""
    gathered: bool
    """Whether it is part of a unit's gathered parameters at all."""
    axis: str = "dp_shard_cp"
    """The mesh axis its unit gathers and reduces over: ``dp_shard_cp``, or ``ep_shard`` for experts
    under expert parallelism."""


@functools.lru_cache(maxsize=65536)  # a planner places the same names for every layout it tries
def _named_layer(name: str) -> int | None:
    """``i`` of a name that says ``layers.<i>``, else None."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def layer_index(name: str, blocks: Mapping[str, int] | None = None) -> int | None:
    """The decoder-layer index of a parameter name, else None.

    ``model.layers.3.mlp.weight`` -> 3; a name that does not say ``layers.<i>`` (GPT-2's, Falcon's,
    Bloom's ``transformer.h.3.mlp.c_fc.weight``) is looked up in ``blocks``, the decoder blocks found
    from the model's structure (`decoder_block_indices`).
    """
    index = _named_layer(name)
    if index is not None or not blocks:
        return index
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        index = blocks.get(".".join(parts[:end]))
        if index is not None:
            return index
    return None


def decoder_block_indices(model: nn.Module) -> dict[str, int]:
    """FQN -> index of the language model's decoder blocks, found from the model's structure.

    `find_transformer_blocks` (``_no_split_modules``, else the repeated layers of a known container),
    the vision, audio and multimodal towers' blocks left out. Empty where no block is found. Mutates
    nothing.
    """
    from automodel_distributed.blocks import block_group, find_transformer_blocks

    try:
        blocks = find_transformer_blocks(model)
    except ValueError:
        return {}
    language = [fqn for fqn, _ in blocks if block_group(fqn) == "language"]
    return {fqn: index for index, fqn in enumerate(language)}


OuterUnits = dict[str, tuple[int, bool]]
"""FQN -> (forward order, resharded even when told not to) of the FSDP units outside the blocks."""


def outer_units(model: nn.Module) -> OuterUnits:
    """The FSDP units `plan_fsdp_units` makes of ``model`` outside its blocks (see `OuterUnits`).

    A function of the model alone (a walk of its modules): a planner trying many layouts of one model
    computes it once and hands it to `placement_rule` and `always_resharded_units`. Mutates nothing.
    """
    from automodel_distributed.blocks import find_transformer_blocks
    from automodel_distributed.fsdp2_units import plan_fsdp_units

    try:
        blocks = {fqn for fqn, _ in find_transformer_blocks(model)}
        planned = plan_fsdp_units(model, reshard_after_forward=False)
    except ValueError:
        return {}
    seen_block, units = False, {}
    for plan in planned:
        seen_block = seen_block or plan.fqn in blocks
        if plan.fqn not in blocks:  # before or after the blocks
            units[plan.fqn] = (1 << 30 if seen_block else 1, bool(plan.reshard_after_forward))
    return units


def _replicated_prefixes(config: DistributedConfig, model: nn.Module) -> tuple[str, ...]:
    """Frozen towers FSDP2 keeps whole on every rank (``frozen_sharding="replicate"``)."""
    if not isinstance(config, FSDP2Config) or config.multimodal.frozen_sharding != "replicate":
        return ()
    from automodel_distributed.fsdp2_units import frozen_towers

    return tuple(fqn + "." for fqn, _ in frozen_towers(model))


def _divisors(config: DistributedConfig, shard: int, tp: int) -> tuple[float, float, float]:
    """Parameter, gradient and optimizer divisors: ``shard``, or ZeRO's stages under Megatron-FSDP."""
    if isinstance(config, MegatronFSDPConfig):
        zero = config.zero_dp_strategy
        return (shard if zero >= 3 else tp, shard if zero >= 2 else tp, shard if zero >= 1 else tp)
    return (shard, shard, shard)


PlacementKey = tuple[int | None, bool, bool, tuple[int, str], bool]
"""What a placement reads of a parameter's name: (block index, an experts parameter, inside a frozen
tower kept whole, its FSDP unit, kept whole by tensor parallelism)."""


@dataclass(frozen=True)
class PlacementRule:
    """How the strategy places each named parameter of one model on one layout (see `placement_rule`).

    Call it with a parameter's name. `key` is the part of the name the placement reads: it depends on
    the model and the strategy's kept-whole towers only, not on the layout, so a planner trying many
    layouts groups the parameters by it once and places one name of each group per layout.
    """

    config: DistributedConfig
    layout: MeshLayout
    experts_gathered: bool
    """Whether experts join FSDP units (they stay out on a one-rank ``ep_shard`` under FSDP2 unless
    their dtype is cast for compute)."""
    whole: tuple[str, ...]
    """Prefixes of the frozen towers every rank keeps whole (`_replicated_prefixes`)."""
    outer: OuterUnits
    blocks: Mapping[str, int]
    """The decoder blocks (`decoder_block_indices`), for names that do not say ``layers.<i>``."""
    tp_whole: frozenset[str] = frozenset()
    """Dense parameters tensor parallelism keeps whole on every TP rank (`tp_replicated_parameters`);
    every other dense parameter is split ``tp`` ways."""

    def key(self, name: str) -> PlacementKey:
        """The parts of ``name`` its placement depends on (equal keys, equal placements)."""
        index = layer_index(name, self.blocks)
        experts = ".experts." in name
        replicated = bool(self.whole) and name.startswith(self.whole)
        if index is not None:
            unit = (2 + 2 * index + (1 if experts else 0), f"block{index}" + (".experts" if experts else ""))
        else:
            unit = next(
                ((order, fqn) for fqn, (order, _) in self.outer.items() if name.startswith(fqn + ".")), _ROOT
            )
        return index, experts, replicated, unit, name in self.tp_whole

    def of_key(self, key: PlacementKey) -> Placement:
        """The placement of every parameter whose name has ``key``."""
        _, experts, replicated, unit, tp_whole = key
        layout, fsdp = self.layout, not isinstance(self.config, DDPConfig)
        tp = 1 if tp_whole else layout.tp
        dense = layout.dp_shard * layout.cp * tp if fsdp else 1
        shard = (layout.ep * layout.ep_shard * layout.tp if layout.ep > 1 else dense) if experts else dense
        over = (layout.ep_shard if experts else layout.dp_shard * layout.cp) if fsdp else 1
        if replicated:
            shard, over = 1, 1
        gathered = over > 1 or (experts and self.experts_gathered)
        axis = "ep_shard" if experts and layout.ep > 1 else "dp_shard_cp"
        return Placement(_divisors(self.config, shard, tp), shard, unit, over, gathered, axis)

    def __call__(self, name: str) -> Placement:
        """The placement of the parameter named ``name``."""
        return self.of_key(self.key(name))


def placement_rule(
    config: DistributedConfig,
    layout: MeshLayout,
    model: nn.Module,
    dtype: torch.dtype,
    *,
    outer: OuterUnits | None = None,
    blocks: Mapping[str, int] | None = None,
    tp_whole: frozenset[str] = frozenset(),
) -> PlacementRule:
    """How the strategy places each named parameter of ``model`` on ``layout`` (see `Placement`).

    FSDP (FSDP2, Megatron-FSDP) shards dense parameters over ``dp_shard x cp x tp`` (those TP keeps
    whole, ``tp_whole``, over ``dp_shard x cp``) and experts over ``ep x ep_shard x tp``; DDP shards
    nothing. Experts on a one-rank ``ep_shard`` stay out of FSDP unless their dtype is cast for compute
    (`automodel_distributed.one_rank_units`). ``outer`` and ``blocks``: `outer_units` and
    `decoder_block_indices` of ``model``, when the caller has them (computed here otherwise);
    ``tp_whole``: `tp_replicated_parameters` of ``model`` (none: TP splits every dense parameter).
    """
    policy = (config.mp_policy if isinstance(config, FSDP2Config) else None) or default_mp_policy()
    experts_gathered = (
        not isinstance(config, FSDP2Config) or layout.ep_shard > 1 or policy.param_dtype not in (None, dtype)
    )
    outer = outer if outer is not None else outer_units(model)
    blocks = blocks if blocks is not None else decoder_block_indices(model)
    whole = _replicated_prefixes(config, model)
    return PlacementRule(config, layout, experts_gathered, whole, outer, blocks, tp_whole)


def tp_replicated_parameters(model: nn.Module, styled: TPStyled | None) -> frozenset[str]:
    """The dense parameters tensor parallelism keeps whole on every TP rank, by name.

    Those outside the plan's column- and row-parallel layers (norms, a router, LoRA's replicated
    ``lora_A`` of a column-parallel layer) and a row-parallel layer's bias, which `RowwiseParallel`
    replicates; experts are left to expert parallelism. ``styled``: `tp_styled_modules` of ``model``;
    None (no plan resolves): empty. Reads only.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if styled is None:
        return frozenset()
    split: set[str] = set()
    for fqn, _, style in styled:
        if isinstance(style, ColwiseParallel | RowwiseParallel):
            own = ("weight", "bias") if isinstance(style, ColwiseParallel) else ("weight",)
            split.update(f"{fqn}.{name}" if fqn else name for name in own)
    names = (name for name, _ in model.named_parameters())
    return frozenset(name for name in names if name not in split and ".experts." not in name)


def always_resharded_units(model: nn.Module, outer: OuterUnits | None = None) -> set[str]:
    """Units FSDP2 reshards after forward even with ``reshard_after_forward=False`` (outside pipelines).

    ``outer``: `outer_units` of ``model``, when the caller has it (computed here otherwise).
    """
    units = outer if outer is not None else outer_units(model)
    return {fqn for fqn, (_, resharded) in units.items() if resharded}


def reshard_setting(config: DistributedConfig, experts_reshard: bool | None) -> bool | int | None:
    """The ``reshard_after_forward`` `FSDP2Manager` gives `plan_fsdp_units`.

    The strategy config's, else (None there) the MoE config's ``experts_reshard``; None for a strategy
    without the setting.
    """
    if not isinstance(config, FSDP2Config):
        return None
    return config.reshard_after_forward if config.reshard_after_forward is not None else experts_reshard


def units_gathered_in_backward(
    model: nn.Module,
    *,
    reshard_after_forward: bool | int | None,
    pipelined: bool,
    blocks: Mapping[str, int] | None = None,
) -> frozenset[str]:
    """The FSDP units whose backward all-gathers their parameters again, by `PlacementRule.key`'s name.

    Those `plan_fsdp_units` reshards after forward (under its default heuristic, every unit but the last
    block and the LM head, which backward needs at once) whose backward reads their weights (not a plain
    embedding's: ``unshard_in_backward``); named ``block<i>`` or by the outer unit's FQN. The root is
    never among them: FSDP2 keeps it gathered from its forward to its backward. ``blocks``:
    `decoder_block_indices` of ``model``, when the caller has it. Mutates nothing.
    """
    from automodel_distributed.fsdp2_units import plan_fsdp_units

    blocks = blocks if blocks is not None else decoder_block_indices(model)
    try:
        planned = plan_fsdp_units(model, reshard_after_forward=reshard_after_forward, pipelined=pipelined)
    except ValueError:
        return frozenset()
    return frozenset(
        f"block{blocks[plan.fqn]}" if plan.fqn in blocks else plan.fqn
        for plan in planned
        if plan.reshard_after_forward and plan.unshard_in_backward
    )


TPStyled = list[tuple[str, nn.Module, Any]]
"""Every ``(fqn, module, style)`` a TP plan applies to a model (`tp_styled_modules`)."""


def tp_styled_modules(model: nn.Module, config: DistributedConfig, tp_size: int) -> TPStyled | None:
    """The modules and styles of the TP plan `apply_tensor_parallel` would apply to ``model``.

    The plan ``config`` names (or the model's, `resolve_tp_plan`), with sequence parallelism as
    configured and LoRA's entries expanded (`expand_lora_plan`). None where no plan resolves for
    ``tp_size``. Reads only.
    """
    from automodel_distributed.tensor_parallel import expand_lora_plan, is_lora_linear, resolve_tp_plan
    from automodel_distributed.tensor_parallel._fqn import match_modules

    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    try:
        plan = resolve_tp_plan(
            model, getattr(config, "tp_plan", None), sequence_parallel=sequence_parallel, tp_size=tp_size
        )
        if any(is_lora_linear(module) for module in model.modules()):
            plan = expand_lora_plan(model, plan)
    except ValueError:
        return None
    return [(fqn, module, style) for key, style in plan.items() for fqn, module in match_modules(model, key)]


def tp_plan_collectives(
    model: nn.Module, styled: TPStyled, blocks: Mapping[str, int] | None = None
) -> TPCollectives:
    """The activation collectives of ``styled`` (`tp_styled_modules`) on ``model`` (`plan_collectives`).

    ``blocks``: `decoder_block_indices` of ``model``, when the caller has it (computed here otherwise).
    """
    from automodel_distributed.tensor_parallel.traffic import plan_collectives

    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
    blocks = blocks if blocks is not None else decoder_block_indices(model)
    return plan_collectives(model, styled, blocks, hidden)


TP_BLOCK_COLLECTIVE = "TP all-reduce (or AG+RS)"
"""The name of the decoder blocks' TP collectives (what async TP micro-pipelines with their matmuls)."""


def _tp_halves(part: PassCollectives | None, gather_runs: int, forward_runs: int) -> tuple[float, float]:
    """``part``'s collectives in one pass as all-gather and reduce-scatter halves (an all-reduce is both).

    How many, and their values per token summed (see `_tp_collectives`).
    """
    if part is None:
        return 0.0, 0.0

    def halves(forward: Counter[str], backward: Counter[str]) -> float:
        runs = forward["all_gather"] * gather_runs
        runs += (forward["reduce_scatter"] + 2 * forward["all_reduce"]) * forward_runs
        return runs + backward["all_gather"] + backward["reduce_scatter"] + 2 * backward["all_reduce"]

    return halves(part.forward, part.backward), halves(part.forward_width, part.backward_width)


def fsdp_buffer_bytes(
    unit_bytes: Sequence[int],
    *,
    shard: int,
    prefetch: int = 1,
    unit_grad_bytes: Sequence[int] | None = None,
    reshard: bool = True,
    always_resharded: Sequence[bool] | None = None,
) -> int:
    """Bytes of FSDP2's gathered (unsharded) parameters at their peak, and the one fresh unit gradient.

    With ``reshard`` (units free their parameters after forward and backward): the largest
    ``1 + prefetch`` units, the running one and the one backward gathers ahead; the running unit's
    gradients also exist unsharded until its reduce-scatter copies them in, so the largest unit
    gradient counts once more. Without ``reshard`` (``reshard_after_forward=False``, or under
    pipelining, where no unit reshards before the last micro-batch's backward): every unit at once.
    With ``shard == 1`` nothing is gathered.

    Args:
        unit_bytes: Bytes of each FSDP unit's parameters on this rank, unsharded over the FSDP axis.
        shard: Ranks each unit is sharded over (``dp_shard_cp``).
        prefetch: Units gathered ahead of the one computing (FSDP2's backward prefetches one).
        unit_grad_bytes: Bytes of each unit's trainable parameters, unsharded (default: all of
            ``unit_bytes`` train); a frozen unit (LoRA's base) makes no gradient.
        reshard: Whether units reshard after forward (see above).
        always_resharded: Per unit, whether it reshards after forward even without ``reshard`` (an
            untied plain embedding outside a pipeline, `automodel_distributed.fsdp2_units.plan_fsdp_units`):
            it runs first and is gathered alone, then freed.
    """
    if shard <= 1 or not unit_bytes:
        return 0
    if not reshard:
        freed = always_resharded or [False] * len(unit_bytes)
        held = sum(b for b, f in zip(unit_bytes, freed, strict=True) if not f)
        return max(held, max((b for b, f in zip(unit_bytes, freed, strict=True) if f), default=0))
    largest = sorted(unit_bytes, reverse=True)
    grads = unit_bytes if unit_grad_bytes is None else unit_grad_bytes
    return sum(largest[: 1 + prefetch]) + max(grads, default=0)


def fsdp_comm_buffer_bytes(
    unit_bytes: Sequence[int],
    *,
    shard: int,
    reduce_bytes: Sequence[int] | None = None,
    host_tuned: bool = False,
) -> int:
    """Bytes of FSDP2's full-size collective buffers at their peak: all-gather outputs, reduce-scatter inputs.

    Each unit's all-gather lands in one flat buffer of the unit's unsharded size, copied out into the
    parameters; in forward FSDP2 frees it only after the next unit's all-gather (to overlap the copy),
    so two units that run one after the other hold two at once. Each reduce-scatter copies the unit's
    gradients into one flat buffer of the reduction dtype, held until the next unit's post-backward,
    that is through the next unit's backward all-gather. Buffers of one size and dtype are reused (the
    host `HostBufferPool` of `automodel_cpu.fsdp_buffer_pool` under a CPU runtime, which keeps them
    from step to step; the caching allocator on GPU). So, per distinct unit size:

    - one dtype for both collectives (``reduce_bytes`` None): the buffers are shared; two when two
      consecutive units have that size (a model's blocks), else one;
    - a wider reduction dtype: all-gather outputs as above, except one per size on the host with
      ``FSDP2Config.host_runtime`` (``host_tuned``: each is freed once copied out,
      `automodel_cpu.fsdp_buffer_pool.free_all_gather_outputs_after_copy_out`), plus
      one reduce-scatter input per size.

    The reduce-scatter *outputs* are the sharded gradients themselves (the gradients line). On the
    host under a CPU runtime a reduce-scatter input above the pool's bound is never filled
    (each piece is copied from the gradients, `automodel_cpu.copy_in_kernel`), so
    counting it there keeps this an upper bound.

    Args:
        unit_bytes: Each FSDP unit's parameter bytes on this rank, unsharded over the FSDP axis, in
            the parameters' (all-gather) dtype, in the order the units run in forward.
        shard: Ranks each unit is sharded over (``dp_shard_cp``); 1: no collective, no buffer.
        reduce_bytes: The same units' bytes in the reduction dtype, when it differs.
        host_tuned: The collectives run on the host under a CPU runtime (``FSDP2Config.host_runtime``).
    """
    if shard <= 1 or not unit_bytes:
        return 0
    consecutive = {before for before, after in itertools.pairwise(unit_bytes) if before == after}
    if reduce_bytes is None:
        return sum(size * (2 if size in consecutive else 1) for size in set(unit_bytes))
    assert len(reduce_bytes) == len(unit_bytes), "one reduction size per unit"
    gathers = sum(size * (2 if size in consecutive and not host_tuned else 1) for size in set(unit_bytes))
    return gathers + sum(set(reduce_bytes))


class StrategyFacts(Protocol):
    """What `StrategyMemory` reads of a planner's per-rank facts (``automodel_planner.RankFacts``)."""

    layout: MeshLayout
    tokens: int
    """Tokens per micro-batch on the rank."""
    rows: int
    """Sequences per micro-batch."""
    hidden_size: int
    element_size: int
    """Bytes per activation value."""
    attention: tuple[int, int]
    """(key/value heads, head dim) of the model."""
    params: float
    grads: float
    states: float
    """Bytes of this rank's parameters, gradients and AdamW state (two values per trainable one, in its
    dtype)."""
    accumulated: float
    """Bytes of this rank's trainable parameters unsharded over the FSDP axis."""
    units: Sequence[int]
    """Each FSDP unit's parameter bytes on this rank, unsharded over the FSDP axis, in forward order, in
    the all-gather dtype (``mp_policy.param_dtype`` where it casts them)."""
    unit_grads: Sequence[int]
    unit_reduce: Sequence[int]
    """Each unit's reduce-scatter input bytes (its trainable parameters in the reduction dtype)."""
    unit_axes: Sequence[str]
    """Each unit's FSDP axis (`Placement.axis`): ``dp_shard_cp``, or ``ep_shard`` for experts."""
    reduce_separate: bool
    """Whether the reduction dtype differs from the all-gather's (separate reduce-scatter buffers)."""
    units_freed: Sequence[bool]
    """Per unit: resharded after forward whatever the setting (`always_resharded_units`)."""
    unit_names: Sequence[str]
    """Per unit: its name as `PlacementRule.key` gives it (``block<i>``, ``block<i>.experts``, an outer
    unit's FQN, ``root``)."""
    first_stage: bool
    """The rank runs the first pipeline stage (the embedding); True without pipelining."""
    last_stage: bool
    """The rank runs the last pipeline stage (the head and the loss); True without pipelining."""
    blocks: Sequence[int]
    n_micro: int
    """The pipeline's micro-batches per step (1 outside pipelining)."""
    accumulation: int
    """Forward/backward passes per optimizer step (gradient accumulation, or the pipeline's)."""
    forward_runs: int
    """Times each block's forward runs per pass (2 when full activation checkpointing recomputes it)."""
    accumulated_elements: float
    """Elements of ``accumulated`` (the trainable parameters the rank holds unsharded)."""
    gather_runs: int
    """Times each block's TP all-gathers run per pass (``forward_runs``, or 2 when selective checkpointing
    does not save their outputs)."""
    pipelined: bool


_DDP_BUCKET_MIB = 25.0
"""torch DDP's bucket size when ``bucket_cap_mb`` is None."""


def _ddp_bucket_bytes(config: DDPConfig) -> float:
    """Bytes of gradients DDP all-reduces in one NCCL operation (one bucket)."""
    return (config.bucket_cap_mb or _DDP_BUCKET_MIB) * 2**20


@dataclass(frozen=True)
class StageSync:
    """How FSDP gathers and reduces over a pipeline run's micro-batches (``backward_maybe_with_nosync``).

    A stage whose root module is FSDP's is driven by torch's stage: its units stay gathered from the
    first micro-batch's forward to the end of the run (``set_reshard_after_backward(False)``) and, by
    default, its gradients stay unsharded until the stage's last backward has run, when they are
    reduced and waited for at once; with ``defer_fsdp_grad_sync`` off, automodel's stage reduces them
    in every micro-batch's backward instead (`automodel_pipelining._runtime`). A stage whose root is
    not FSDP's (experts sharded on their own mesh, ``wrap_outer_model=False``) is left to FSDP's own
    hooks: each micro-batch gathers, reshards after its backward and reduces there, unless
    ``patch_stage_backward_maybe_with_nosync`` applies the deferral to the nested units (reduced in the
    last micro-batch's backward).

    Args:
        gathered: The units stay gathered over the run's micro-batches.
        reduce: ``after_last`` (after the stage's last backward), ``last`` (in the last micro-batch's
            backward) or ``every`` (in every micro-batch's backward).
    """

    gathered: bool
    reduce: Literal["after_last", "last", "every"]

    @classmethod
    def for_stage(cls, *, root_is_fsdp: bool, defer: bool, patch_nested: bool) -> StageSync:
        """The sync of a stage, from its root module and the job's settings (see the class doc)."""
        if root_is_fsdp:
            return cls(gathered=True, reduce="after_last" if defer else "every")
        return cls(gathered=False, reduce="last" if defer and patch_nested else "every")


def _local_kv_bytes(facts: StrategyFacts) -> float:
    """Bytes of a rank's keys and values in one attention call: its tokens, its TP share of the heads."""
    kv, head_dim = facts.attention
    return 2 * facts.tokens * kv * head_dim * facts.element_size / facts.layout.tp


@dataclass(frozen=True)
class StrategyMemory:
    """The strategy's lines of a rank's peak, its collective buffers and its traffic (a planner term).

    Args:
        config: The strategy config.
        reshard: Whether FSDP units free their parameters after forward (`for_job`).
        stage: How a pipeline stage drives FSDP over its micro-batches; None without pipelining.
    """

    config: DistributedConfig
    reshard: bool
    stage: StageSync | None = None
    backward_gathered: frozenset[str] | None = None
    """Names of the units whose backward gathers them again when ``reshard`` (`units_gathered_in_backward`,
    matched against the facts' ``unit_names``); None: every unit."""
    tensor_parallel: TPCollectives | None = None
    """The TP plan's collectives per block, before and after the blocks
    (`automodel_distributed.tensor_parallel.traffic.plan_collectives`); None: a Megatron-style block's."""

    @classmethod
    def for_job(
        cls,
        config: DistributedConfig,
        *,
        stage: StageSync | None,
        experts_reshard: bool | None,
        backward_gathered: frozenset[str] | None = None,
        tensor_parallel: TPCollectives | None = None,
    ) -> StrategyMemory:
        """The term of ``config``, resharding as its manager does.

        Args:
            config: The strategy config.
            stage: How a pipeline stage drives FSDP (`StageSync`); None without pipelining. Under
                pipelining no unit reshards after forward unless the config says so.
            experts_reshard: Under expert parallelism, the MoE config's ``reshard_after_forward``, which
                `FSDP2Manager` applies where the strategy config leaves it unset; None without experts.
            backward_gathered: `units_gathered_in_backward` of the job's model under `reshard_setting`;
                None: every unit, when units reshard.
            tensor_parallel: The job's TP plan's collectives (`plan_collectives`); None: a
                Megatron-style block's.
        """
        setting = reshard_setting(config, experts_reshard)
        reshard = setting is not False and not (stage is not None and setting is None)
        return cls(config, reshard, stage, backward_gathered, tensor_parallel)

    @property
    def checkpointing(self) -> Any:
        """``False``, ``"full"`` or ``"selective"``: what the strategy recomputes."""
        return resolve_checkpointing_mode(self.config.activation_checkpointing) or False

    @property
    def sequence_parallel(self) -> bool:
        """Whether hidden states between the tensor-parallel regions are sharded over ``tp`` too."""
        return isinstance(self.config, FSDP2Config) and self.config.sequence_parallel

    @property
    def _fsdp(self) -> bool:
        return not isinstance(self.config, DDPConfig)

    def deferred(self, accumulation: int) -> bool:
        """Whether FSDP2 keeps each of ``accumulation`` passes' gradients unsharded until the last one.

        Under a pipeline, as its stage drives FSDP (`StageSync`); else as ``defer_fsdp_grad_sync`` says.
        """
        config = self.config
        if not isinstance(config, FSDP2Config) or accumulation <= 1:
            return False
        return config.defer_fsdp_grad_sync if self.stage is None else self.stage.reduce != "every"

    def memory(self, facts: StrategyFacts) -> list[tuple[str, int, str]]:
        """Parameters, gradients, AdamW state, deferred gradients and the gathered FSDP units."""
        lines = [
            ("parameters", int(facts.params), ""),
            ("gradients", int(facts.grads), ""),
            ("optimizer", int(facts.states), "AdamW: 2 states per trainable parameter, in its dtype"),
        ]
        if self.deferred(facts.accumulation) and facts.accumulated:
            note = f"unsharded, unreduced over {facts.accumulation} micro-batches (defer_fsdp_grad_sync)"
            lines.append(("accumulated gradients", int(facts.accumulated), note))
        if self._fsdp:
            lines.append(("gathered units", self._gathered(facts), self._gathered_note()))
        return lines

    def _gathered(self, facts: StrategyFacts) -> int:
        freed = [not facts.pipelined and f for f in facts.units_freed]
        shard = facts.layout.dp_shard * facts.layout.cp
        return fsdp_buffer_bytes(
            facts.units,
            shard=shard,
            unit_grad_bytes=facts.unit_grads,
            reshard=self.reshard,
            always_resharded=freed,
        )

    def _gathered_note(self) -> str:
        if self.reshard:
            return "the 2 largest FSDP units unsharded + 1 unit's full-size gradient"
        return (
            "every FSDP unit of the rank stays unsharded (pipelining / reshard_after_forward=False; "
            "outside a pipeline an untied embedding is freed after forward)"
        )

    def buffers(self, facts: StrategyFacts) -> dict[str, int]:
        """FSDP2's all-gather outputs and reduce-scatter inputs, DDP's buckets, TP's and CP's buffers."""
        layout, out = facts.layout, {}
        shard = layout.dp_shard * layout.cp
        fsdp = 0
        if self._fsdp:
            reduce = list(facts.unit_reduce) if facts.reduce_separate else None
            host = isinstance(self.config, FSDP2Config) and self.config.host_runtime is not None
            fsdp = fsdp_comm_buffer_bytes(facts.units, shard=shard, reduce_bytes=reduce, host_tuned=host)
        if fsdp:
            out["FSDP all-gather / reduce-scatter"] = fsdp
        if isinstance(self.config, DDPConfig) and layout.world_size > 1:
            out["DDP gradient buckets"] = int(facts.grads)  # a second copy of the gradients
        if layout.tp > 1:
            out["TP gathered hidden states"] = facts.tokens * facts.hidden_size * facts.element_size
        if layout.cp > 1:
            out["CP all-gathered K/V"] = int(layout.cp * _local_kv_bytes(facts))
        return out

    def traffic(self, facts: StrategyFacts) -> float:
        """Bytes the strategy's own kernels move per step: deferred gradients' sums, SP's layout copies."""
        return self._accumulation_traffic(facts) + self._sequence_parallel_copies(facts)

    def _accumulation_traffic(self, facts: StrategyFacts) -> float:
        """What adding each pass's gradients into those deferred moves (`deferred`).

        The first backward makes the unsharded gradients in the compute dtype, and they are cast to
        the accumulation dtype (the parameters'); every later one adds its own to them in place
        (autograd's AccumulateGrad: read both, write the sum). 0 when nothing is deferred.
        """
        if not (self.deferred(facts.accumulation) and facts.accumulated):
            return 0.0
        fresh = facts.accumulated_elements * facts.element_size  # one backward's, in the compute dtype
        cast = fresh + facts.accumulated
        return cast + (facts.accumulation - 1) * (fresh + 2 * facts.accumulated)

    def _sequence_parallel_copies(self, facts: StrategyFacts) -> float:
        """What moving the sequence dim to and from NCCL's rank-major layout copies under SP.

        NCCL gathers and scatters along a tensor's first dim; sequence parallelism shards the second
        (``[batch, seq, hidden]``). So torch's functional collectives copy the whole gathered tensor
        (read and written) into place after each all-gather unless a micro-batch holds one sequence
        (``_maybe_view_chunk_cat`` returns a view then), and before each reduce-scatter always
        (``_chunk_or_narrow_cat``); torch.compile keeps both as copy kernels. Per block and pass: the
        forward's two of each per run, mirrored once in backward. Under async TP the fused matmuls move
        the layout themselves (a ``1 / tp`` shard); only backward's two reduce-scatters of a
        column-parallel group's summed input gradient stay plain collectives.
        """
        if facts.layout.tp == 1 or not self.sequence_parallel:
            return 0.0
        assert isinstance(self.config, FSDP2Config), "sequence parallelism is an FSDP2Config setting"
        if self.config.enable_async_tensor_parallel:
            copies = 2
        else:
            copies = 2 * facts.forward_runs + 2
            if facts.rows > 1:
                copies += 2 * facts.gather_runs + 2
        gathered = facts.tokens * facts.hidden_size * facts.element_size
        return copies * 2 * gathered * len(facts.blocks) * facts.accumulation

    def _fsdp_collectives(self, facts: StrategyFacts, axis: str) -> list[Collective]:
        """FSDP's all-gathers and reduce-scatters of the units sharded over ``axis`` (see `collectives`)."""
        layout = facts.layout
        shard = layout.dp_shard * layout.cp if axis == "dp_shard_cp" else layout.ep_shard
        members = [i for i, unit_axis in enumerate(facts.unit_axes) if unit_axis == axis]
        if shard == 1 or not members:
            return []
        passes, gathers, ring = facts.accumulation, 2 if self.reshard else 1, (shard - 1) / shard
        name = f"FSDP all-gather x{gathers}"  # a call: every unit's, one by one (an operation each)
        # FSDP reshards every unit after its backward unless a pipeline stage keeps it gathered
        # (``set_reshard_after_backward(False)``): a unit kept gathered after forward is still gathered
        # again in the next micro-batch's forward.
        kept = not self.reshard and self.stage is not None and self.stage.gathered
        forward = ring * sum(facts.units[i] for i in members)
        calls = 1 if kept else passes
        out = [Collective(name, axis, forward, calls, Overlap.FORWARD, operations=len(members))]
        again = [i for i in members if self._gathered_in_backward(facts, i)]
        if again:
            backward = ring * sum(facts.units[i] for i in again)
            out.append(Collective(name, axis, backward, passes, Overlap.BACKWARD, operations=len(again)))
        reduced = ring * sum(facts.unit_reduce[i] for i in members)
        reduction = self._reduction("FSDP reduce-scatter", axis, reduced, passes)
        return [*out, reduction._replace(operations=len(members))]

    def _gathered_in_backward(self, facts: StrategyFacts, unit: int) -> bool:
        """Whether the backward of the facts' ``unit``-th unit all-gathers it again.

        An experts unit does as its block does.
        """
        if not self.reshard:
            return False
        if self.backward_gathered is None:
            return True
        return facts.unit_names[unit].removesuffix(".experts") in self.backward_gathered

    def _tp_collectives(self, facts: StrategyFacts) -> list[Collective]:
        """The blocks' TP collectives per pass, and those of the embedding, the head and the loss.

        Counted from the plan's styles (`tensor_parallel`), each an activation of its layer's width
        moved as all-gather and reduce-scatter halves (an all-reduce is both): a block's forward ones
        in each of its forward runs (its all-gathers in each gather run), its backward ones once; a
        vocab-parallel loss's per-token fp32 all-reduces on the stage holding the head; the replicated
        parameters' ``Partial`` gradients once per step. Without a plan, a Megatron-style block: two
        of each per forward run, mirrored once in backward.
        """
        tp, passes = facts.layout.tp, facts.accumulation
        ring = (tp - 1) / tp
        tokens, element = facts.tokens, facts.element_size
        outside, loss = (0.0, 0.0), 0
        if self.tensor_parallel is None:
            block = 2.0 * (facts.gather_runs + facts.forward_runs) + 4
            per_block = [(block, block * facts.hidden_size)] * len(facts.blocks)
        else:
            blocks, entry, exit_ = self.tensor_parallel
            runs = facts.gather_runs, facts.forward_runs
            per_block = [_tp_halves(blocks.get(b), *runs) for b in facts.blocks]
            parts = ([entry] if facts.first_stage else []) + ([exit_] if facts.last_stage else [])
            halves = [_tp_halves(part, 1, 1) for part in parts]  # outside the blocks: never recomputed
            outside = (sum(h[0] for h in halves), sum(h[1] for h in halves))
            loss = 2 * exit_.loss_reductions if facts.last_stage else 0
        out = []
        if per_block and sum(h[0] for h in per_block):
            count, width = (sum(h[i] for h in per_block) / len(per_block) for i in (0, 1))
            sent, calls = ring * width * tokens * element, len(per_block) * passes
            out.append(Collective(TP_BLOCK_COLLECTIVE, "tp", sent, calls, Overlap.EXPOSED, operations=count))
        if outside[0] or loss:
            sent = ring * tokens * (outside[1] * element + loss * 4)  # the loss's values in fp32
            rest = Collective("TP embedding, head and loss", "tp", sent, passes, Overlap.EXPOSED)
            out.append(rest._replace(operations=outside[0] + loss))
        partial = self._partial_grads(facts)
        if partial:  # each parameter on its own (in the compute dtype), each time it is read
            sent = 2 * ring * sum(partial) * facts.element_size
            # FSDP's reduction reads it once and keeps the sum. Without FSDP, DTensor sums a Partial
            # gradient again at every read: AdamW's three (its first moment's lerp, the second's
            # addcmul of the gradient by itself).
            reads = 1 if facts.layout.dp_shard * facts.layout.cp > 1 else 3
            grads = Collective("TP replicated gradients", "tp", sent, reads, Overlap.EXPOSED, all_reduce=True)
            out.append(grads._replace(operations=len(partial)))
        return out

    def _partial_grads(self, facts: StrategyFacts) -> list[int]:
        """Elements of each of the rank's replicated parameters with a ``Partial`` TP gradient."""
        if self.tensor_parallel is None:
            return []
        blocks, entry, exit_ = self.tensor_parallel
        parts = [blocks[b] for b in facts.blocks if b in blocks]
        parts += ([entry] if facts.first_stage else []) + ([exit_] if facts.last_stage else [])
        return [n for part in parts for n in part.partial_grads]

    def _reduction(self, name: str, axis: str, sent: float, passes: int) -> Collective:
        """A gradient reduction: in every pass's backward, the last one's, or after a stage's last."""
        if self.stage is not None and self.stage.reduce == "after_last":
            return Collective(name, axis, sent, 1, Overlap.AFTER_LAST_BACKWARD)
        return Collective(name, axis, sent, 1 if self.deferred(passes) else passes, Overlap.BACKWARD)

    def collectives(self, facts: StrategyFacts) -> list[Collective]:
        """What the strategy sends per step, collective by collective, with ring-algorithm factors.

        FSDP gathers every unit over the unit's own axis (experts under expert parallelism over
        ``ep_shard``, the rest over ``dp_shard_cp``) in each forward (and again in backward when units
        reshard after forward, as they do for every micro-batch of gradient accumulation; once per run
        where a pipeline stage keeps them gathered); gradients are reduce-scattered over the same axis
        in the reduction dtype, and HSDP's all-reduced over the replicas, once per step (the last
        micro-batch's backward) when ``defer_fsdp_grad_sync`` defers them, else in every micro-batch's
        backward; under a pipeline as its stage drives them (`StageSync`: after an FSDP root's last
        backward, with nothing beside it). TP's collectives are its plan's (`_tp_collectives`): a block's
        forward ones again in a recompute. CP runs torch's ring
        attention with its default all-gather rotation: each attention call gathers the block's K/V
        (in each forward run and again in backward) and waits for them after its first (local) step;
        backward passes each chunk's fp32 K/V gradients on around the ring, one step ahead, and waits
        for the last one right away.
        """
        layout = facts.layout
        if isinstance(self.config, DDPConfig):
            world = layout.world_size
            if world == 1:
                return []
            reduced = 2 * (world - 1) / world * facts.grads
            buckets = max(math.ceil(facts.grads / _ddp_bucket_bytes(self.config)), 1)
            ddp = Collective("all-reduce gradients (DDP)", "world", reduced, 1, Overlap.BACKWARD)
            return [ddp._replace(operations=buckets, all_reduce=True)]  # an all-reduce per bucket
        out = [c for axis in ("dp_shard_cp", "ep_shard") for c in self._fsdp_collectives(facts, axis)]
        if layout.dp_replicate > 1:
            r = layout.dp_replicate
            reduced = 2 * (r - 1) / r * facts.grads
            hsdp = self._reduction("HSDP all-reduce", "dp_replicate", reduced, facts.accumulation)
            out.append(hsdp._replace(operations=len(facts.units), all_reduce=True))  # one per unit
        element, calls = facts.element_size, len(facts.blocks) * facts.accumulation
        if layout.tp > 1:
            out.extend(self._tp_collectives(facts))
        if layout.cp > 1:
            cp, kv = layout.cp, _local_kv_bytes(facts)
            gather, runs = (cp - 1) * kv, facts.forward_runs
            out.append(Collective("CP K/V all-gather", "cp", gather, calls * runs, Overlap.RING_STEP_FORWARD))
            out.append(Collective("CP K/V all-gather", "cp", gather, calls, Overlap.RING_STEP_BACKWARD))
            grads, ring = kv / element * 4, (cp - 1) * calls  # accumulated and passed on in fp32
            out.append(Collective("CP K/V gradients", "cp", grads, ring, Overlap.RING_STEP_BACKWARD, "p2p"))
            out.append(Collective("CP K/V gradients", "cp", grads, calls, Overlap.EXPOSED, "p2p"))
        return out
