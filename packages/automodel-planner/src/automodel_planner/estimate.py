"""`estimate_peak`: the peak memory per rank of one training step with AdamW, line by line, and its traffic.

The rank holding the most is reported (`PeakEstimate`). Every line comes from the term of the package
that owns it (`automodel_planner.terms`); the activations from the model's own forward on fake
tensors (`automodel_planner.activations`). No process group, no memory allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from automodel_mesh import traffic_of
from automodel_planner.activations import StepProfile, build_fake_model, profile_step
from automodel_planner.facts import RankFacts, rank_facts
from automodel_planner.hardware import Cluster
from automodel_planner.inputs import PlanInput
from automodel_planner.step_time import (
    ATTENTION_KERNEL_SPEED,
    DEFAULT_EFFICIENCY,
    Efficiency,
    StepOptions,
    StepTime,
    WeightKinds,
    estimate_step_time,
    model_flops_per_token,
    weight_kinds,
)
from automodel_planner.terms import PlannerTerm, pipeline_term, planner_terms

__all__ = [
    "PeakEstimate",
    "ProfileCache",
    "calibrate_efficiency",
    "estimate_peak",
    "estimate_throughput",
    "flops_per_token",
    "step_profile",
    "with_allocator_reserve",
]

ProfileCache = dict[tuple[int, int, int], StepProfile]
"""Profiles of the fake forward reused across layouts, by (micro-batch, sequence length, cp)."""

ALLOCATOR_RESERVE = 0.080
"""What torch's CUDA caching allocator reserves beyond the live tensors at the peak, as a fraction of them:
blocks cached for reuse and the unused tails of split segments, which ``max_memory_reserved`` (what a
job must fit in, what torchtitan reports) counts and the tensors do not. One number for every job,
fitted on the calibration rows' published peaks (`automodel_planner.published.fit_allocator_reserve`,
``python tools/throughput_doc.py --fit``), never per run. A CPU run has no caching allocator."""


@dataclass
class PeakEstimate:
    """The largest rank's memory, line by line, and the per-step communication volume of a rank."""

    rank: str
    """Which rank it is (``pp rank 0``, or ``every rank``)."""
    lines: dict[str, int] = field(default_factory=dict)
    """Name -> bytes, in the order printed."""
    notes: dict[str, str] = field(default_factory=dict)
    communication: dict[str, int] = field(default_factory=dict)
    """Collective -> bytes a rank sends per optimizer step."""
    buffers: dict[str, int] = field(default_factory=dict)
    """Mechanism -> bytes of the ``communication buffers`` line."""
    groups: dict[str, frozenset[str]] = field(default_factory=dict)
    """Mesh axis -> how the rank's collectives over it move bytes (`automodel_mesh.Collective.pattern`):
    the process groups, hence NCCL communicators, it uses (`automodel_planner.runtime_memory`)."""

    @property
    def total(self) -> int:
        """The estimated peak: the sum of the lines."""
        return sum(self.lines.values())

    @property
    def communication_total(self) -> int:
        """Bytes sent per step, all collectives."""
        return sum(self.communication.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "peak_bytes": self.total,
            "lines": dict(self.lines),
            "notes": dict(self.notes),
            "communication_buffers_bytes": dict(self.buffers),
            "communication_bytes": dict(self.communication),
            "communication_total_bytes": self.communication_total,
        }


def step_profile(plan: PlanInput, cache: ProfileCache | None = None) -> StepProfile:
    """The fake forward's profile of ``plan``'s micro-batch on one rank (from ``cache`` when it holds it)."""
    cache = cache if cache is not None else {}
    micro_batch = plan.pipeline.pp_microbatch_size if plan.pipeline is not None else plan.micro_batch_size
    key = (micro_batch, plan.seq_len, plan.layout.cp)
    if key not in cache:
        implementation = plan.attn_implementation
        fake = plan.model_fact(  # one build serves every shape the layouts of this model profile
            f"fake model {plan.dtype} {implementation}",
            lambda: build_fake_model(plan.model_config, plan.dtype, implementation),
        )
        cache[key] = profile_step(
            plan.model_config,
            micro_batch=micro_batch,
            seq_len=plan.seq_len,
            dtype=plan.dtype,
            cp=plan.layout.cp,
            attn_implementation=implementation,
            fake=fake,
        )
    return cache[key]


def _planned_ranks(
    plan: PlanInput, cache: ProfileCache | None
) -> tuple[StepProfile, Any, list[PlannerTerm], list[RankFacts]]:
    """``plan``'s profile, pipeline term, planner terms and rank facts; all but the profile once per plan.

    They are functions of the plan alone (and its profile), kept in ``plan.memo``: the memory and the
    time estimates of one plan (and a calibration's repeated time estimates) share them.
    """
    profile = step_profile(plan, cache)
    activations = profile.activations
    key = ("ranks", activations.tokens, len(activations.blocks))
    if key not in plan.memo:
        pipeline = pipeline_term(plan)
        terms = planner_terms(plan, activations, pipeline)
        ranks = rank_facts(
            plan, pipeline=pipeline, tokens=activations.tokens, profiled_blocks=len(activations.blocks)
        )
        plan.memo[key] = (pipeline, terms, ranks)
    pipeline, terms, ranks = plan.memo[key]
    return profile, pipeline, terms, ranks


def _rank_estimate(facts: RankFacts, terms: list[PlannerTerm]) -> PeakEstimate:
    estimate = PeakEstimate(rank=facts.label)
    for term in terms:
        for name, size, note in term.memory(facts):
            estimate.lines[name] = size
            if note:
                estimate.notes[name] = note
        estimate.buffers.update(term.buffers(facts))
        collectives = term.collectives(facts)
        estimate.communication.update(traffic_of(collectives))
        for c in collectives:
            estimate.groups[c.axis] = estimate.groups.get(c.axis, frozenset()) | {c.pattern}
    if estimate.buffers:
        estimate.lines["communication buffers"] = sum(estimate.buffers.values())
        estimate.notes["communication buffers"] = ", ".join(estimate.buffers)
    return estimate


def with_allocator_reserve(estimate: PeakEstimate, fraction: float = ALLOCATOR_RESERVE) -> PeakEstimate:
    """``estimate`` on a GPU: a new estimate with the caching allocator's reserve as a line of its own.

    The CUDA context and NCCL's buffers are outside torch's allocator (and the published peaks, which are
    its reserved memory): `automodel_planner.runtime_memory.with_process_memory` adds them after this.
    """
    out = dataclasses.replace(estimate, lines=dict(estimate.lines), notes=dict(estimate.notes))
    out.lines["allocator reserve"] = int(fraction * estimate.total)
    out.notes["allocator reserve"] = (
        f"torch's CUDA caching allocator: {fraction:.1%} over the live tensors (ALLOCATOR_RESERVE)"
    )
    return out


def estimate_peak(plan: PlanInput, *, profile_cache: ProfileCache | None = None) -> PeakEstimate:
    """Peak memory of the rank holding the most, for one training step with AdamW, and its traffic.

    Args:
        plan: The job.
        profile_cache: Activation profiles to reuse (and fill), e.g. across the layouts of ``--suggest``.

    Returns:
        The itemised estimate of the largest rank (the first of equals).
    """
    _, _, terms, ranks = _planned_ranks(plan, profile_cache)
    estimates = [_rank_estimate(facts, terms) for facts in ranks]
    return max(estimates, key=lambda e: e.total)


_KERNELS = {"flash_attention_3": "fa3"}
"""The attention kernel of a transformers ``attn_implementation`` other than FlashAttention-2's: SDPA,
flash_attention_2 and the rest run FA2 (or slower kernels the time model does not price apart)."""


def _attention_kernel(plan: PlanInput) -> str:
    """The attention kernel the time model prices for ``plan`` (`PlanInput.attention_kernel`)."""
    kernel = plan.attention_kernel or _KERNELS.get(plan.attn_implementation or "", "fa2")
    if kernel not in ATTENTION_KERNEL_SPEED:
        raise ValueError(
            f"attention_kernel: {kernel!r} is not one the time model prices; use one of "
            f"{sorted(ATTENTION_KERNEL_SPEED)}"
        )
    return kernel


def estimate_throughput(
    plan: PlanInput,
    cluster: Cluster,
    *,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
    profile_cache: ProfileCache | None = None,
) -> StepTime:
    """One optimizer step's time on ``cluster``, part by part, with tokens/s per GPU and MFU.

    Args:
        plan: The job (its layout's world size must be the cluster's GPU count).
        cluster: The hardware (`automodel_planner.hardware`).
        efficiency: The achievable fractions of the hardware's peaks (default: fitted on published runs).
        profile_cache: Profiles of the fake forward to reuse (and fill).

    Raises:
        ValueError: The cluster's GPU count is not the layout's world size, or float8 on a device
            without float8 tensor cores.
    """
    from automodel_distributed.activation_checkpointing import resolve_checkpointing_mode

    if cluster.count != plan.layout.world_size:
        raise ValueError(
            f"the cluster has {cluster.count} GPUs but the layout spans {plan.layout.world_size} ranks: "
            "plan for the cluster's GPU count (--cluster sets the world size)"
        )
    fp8 = plan.fp8 is not None and plan.fp8.enabled
    if fp8 and cluster.device.fp8_flops is None:
        raise ValueError(
            f"fp8.enabled: {cluster.device.name} has no float8 tensor cores (torchao's float8 training needs "
            "compute capability 8.9 or later: H100, H200, B200); plan it without fp8"
        )
    kernel = _attention_kernel(plan)
    profile, pipeline, terms, ranks = _planned_ranks(plan, profile_cache)
    options = StepOptions(
        compile=plan.compile or bool(getattr(plan.strategy, "enable_compile", False)),
        fp8=fp8,
        async_tp=bool(getattr(plan.strategy, "enable_async_tensor_parallel", False)),
        checkpointing=resolve_checkpointing_mode(plan.strategy.activation_checkpointing) or False,
        # Vocabulary-parallel logits (tp > 1) keep MaskedCrossEntropy's sharded eager loss.
        compiled_loss=plan.compiled_loss and plan.layout.tp == 1,
        attention_kernel=kernel,
    )
    step = estimate_step_time(
        ranks=ranks,
        terms=terms,
        compute=profile.compute,
        kinds=_weight_kinds(plan),
        cluster=cluster,
        tokens_per_step=plan.tokens_per_step,
        options=options,
        stages_per_rank=pipeline.stages_per_rank if pipeline is not None else 1,
        efficiency=efficiency,
    )
    if pipeline is not None and plan.pipeline_runs > 1:  # each run: its passes, bubble and reduction
        step.parts = {
            part: seconds * (1 if part == "optimizer" else plan.pipeline_runs)
            for part, seconds in step.parts.items()
        }
    return step


def flops_per_token(plan: PlanInput, *, profile_cache: ProfileCache | None = None) -> float:
    """Training FLOPs per token of ``plan``'s model as torchtitan counts them (for MFU; no recompute).

    The count `estimate_throughput` uses (`step_time.model_flops_per_token`): three times the forward's
    matmul FLOPs of trainable weights, twice those of frozen ones, three times the attention's.
    """
    profile = step_profile(plan, profile_cache)
    return model_flops_per_token(profile.compute, _weight_kinds(plan), cp=plan.layout.cp)


def _weight_kinds(plan: PlanInput) -> WeightKinds:
    """`weight_kinds` of ``plan``'s model, memoized (a function of the model and of expert parallelism).

    Under expert parallelism the experts modules are marked: a rank's matmuls read its experts only.
    """
    from automodel_distributed.blocks import find_transformer_blocks

    def kinds() -> WeightKinds:
        experts: frozenset[str] = frozenset()
        if plan.layout.ep > 1:
            from automodel_moe import find_experts

            experts = frozenset(site.fqn for site in find_experts(plan.model))
        return weight_kinds(plan.model, find_transformer_blocks(plan.model), experts)

    return plan.model_fact("weight_kinds" if plan.layout.ep == 1 else "weight_kinds, ep", kinds)


def calibrate_efficiency(
    plan: PlanInput,
    cluster: Cluster,
    measured_step_seconds: float,
    *,
    start: Efficiency = DEFAULT_EFFICIENCY,
    profile_cache: ProfileCache | None = None,
) -> tuple[Efficiency, float]:
    """Scale the compute fractions of ``start`` so that ``plan``'s predicted step takes the measured time.

    One measured run determines one number: the matmul, float8, attention and memory fractions are
    scaled together by one factor (none above 1), found by bisection (the step time falls as the
    factor grows); ``network`` is kept. Returns the calibrated efficiency and the factor.

    Raises:
        ValueError: A measured time that is not positive, or one that no factor reaches (faster than
            every fraction at 1, or slower than a hundredth of the start), naming the bound.
    """
    if not measured_step_seconds > 0:
        raise ValueError(f"the measured step time must be positive, got {measured_step_seconds!r}")
    fields = ("matmul", "fp8_matmul", "attention", "memory")
    cache = profile_cache if profile_cache is not None else {}

    def scaled(factor: float) -> Efficiency:
        return dataclasses.replace(start, **{f: getattr(start, f) * factor for f in fields})

    def seconds(factor: float) -> float:
        return estimate_throughput(plan, cluster, efficiency=scaled(factor), profile_cache=cache).step_seconds

    low, high = 0.01, 1.0 / max(getattr(start, f) for f in fields)
    if seconds(high) > measured_step_seconds:
        raise ValueError(
            f"the measured step ({measured_step_seconds:.3f} s) is faster than the model allows on "
            f"{cluster.describe()} with every fraction of peak at 1 ({seconds(high):.3f} s): is the "
            "cluster the one that was measured?"
        )
    if seconds(low) < measured_step_seconds:
        raise ValueError(
            f"the measured step ({measured_step_seconds:.3f} s) is slower than the model predicts at a "
            f"hundredth of the fitted fractions ({seconds(low):.3f} s): is the job the one that was measured?"
        )
    for _ in range(30):  # the factor to a billionth
        middle = (low + high) / 2
        low, high = (middle, high) if seconds(middle) > measured_step_seconds else (low, middle)
    factor = (low + high) / 2
    return scaled(factor), factor
