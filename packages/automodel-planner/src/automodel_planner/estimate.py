"""`estimate_peak`: the peak memory per rank of one training step with AdamW, line by line, and its traffic.

The rank holding the most is reported (`PeakEstimate`). Every line comes from the term of the package
that owns it (`automodel_planner.terms`); the activations from the model's own forward on fake
tensors (`automodel_planner.activations`). No process group, no memory allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from automodel_planner.activations import ActivationProfile, profile_activations
from automodel_planner.facts import RankFacts, rank_facts
from automodel_planner.inputs import PlanInput
from automodel_planner.terms import PlannerTerm, pipeline_term, planner_terms

__all__ = ["PeakEstimate", "ProfileCache", "estimate_peak"]

ProfileCache = dict[tuple[int, int, int], ActivationProfile]
"""Activation profiles reused across layouts, by (micro-batch, sequence length, cp)."""


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


def _profile(plan: PlanInput, cache: ProfileCache) -> ActivationProfile:
    micro_batch = plan.pipeline.pp_microbatch_size if plan.pipeline is not None else plan.micro_batch_size
    key = (micro_batch, plan.seq_len, plan.layout.cp)
    if key not in cache:
        cache[key] = profile_activations(
            plan.model_config,
            micro_batch=micro_batch,
            seq_len=plan.seq_len,
            dtype=plan.dtype,
            cp=plan.layout.cp,
            attn_implementation=plan.attn_implementation,
        )
    return cache[key]


def _rank_estimate(facts: RankFacts, terms: list[PlannerTerm]) -> PeakEstimate:
    estimate = PeakEstimate(rank=facts.label)
    for term in terms:
        for name, size, note in term.memory(facts):
            estimate.lines[name] = size
            if note:
                estimate.notes[name] = note
        estimate.buffers.update(term.buffers(facts))
        estimate.communication.update(term.traffic(facts))
    if estimate.buffers:
        estimate.lines["communication buffers"] = sum(estimate.buffers.values())
        estimate.notes["communication buffers"] = ", ".join(estimate.buffers)
    return estimate


def estimate_peak(plan: PlanInput, *, profile_cache: ProfileCache | None = None) -> PeakEstimate:
    """Peak memory of the rank holding the most, for one training step with AdamW, and its traffic.

    Args:
        plan: The job.
        profile_cache: Activation profiles to reuse (and fill), e.g. across the layouts of ``--suggest``.

    Returns:
        The itemised estimate of the largest rank (the first of equals).
    """
    profile = _profile(plan, profile_cache if profile_cache is not None else {})
    pipeline = pipeline_term(plan)
    terms = planner_terms(plan, profile, pipeline)
    ranks = rank_facts(plan, pipeline=pipeline, tokens=profile.tokens, profiled_blocks=len(profile.blocks))
    estimates = [_rank_estimate(facts, terms) for facts in ranks]
    return max(estimates, key=lambda e: e.total)
