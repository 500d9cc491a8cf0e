"""`PlannerTerm`: the one small protocol through which each package contributes to a rank's estimate.

A term reads a rank's facts (`automodel_planner.facts.RankFacts`) and returns its lines of the peak,
the collective buffers it holds at the peak (by mechanism), the collectives it issues per step
(`automodel_mesh.Collective`: bytes, calls, axis and what each hides behind) and the device-memory
traffic of its own kernels (FSDP2's accumulation of deferred gradients). Each term lives with the
package that owns what it counts, and reads the facts structurally (its own small ``Protocol`` of the
fields it needs), so no package imports the planner:

- `automodel_distributed.memory.StrategyMemory` (the strategy): parameters, gradients, AdamW state, the
  gathered FSDP units, the FSDP / DDP / TP / CP buffers and traffic;
- `ActivationMemory` (here): saved activations, from the model's own forward on fake tensors;
- ``automodel_peft.memory.LoRAMemory``: the adapters' saved activations;
- ``automodel_quant.memory.FP8Memory``: float8 casts;
- ``automodel_pipelining.memory.PipelineMemory``: receive buffers, point-to-point traffic;
- ``automodel_moe.memory.ExpertMemory``: the all-to-all's buffers and traffic.

`planner_terms` picks the terms a job needs, in the order their lines print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from automodel_distributed.memory import (
    StageSync,
    StrategyMemory,
    reshard_setting,
    tp_plan_collectives,
    units_gathered_in_backward,
)
from automodel_mesh import Collective
from automodel_planner.activations import ActivationProfile, activation_bytes, held_per_microbatch
from automodel_planner.facts import RankFacts, decoder_blocks, tp_plan_key, tp_styled
from automodel_planner.inputs import PlanInput

__all__ = ["ActivationMemory", "PlannerTerm", "pipeline_term", "planner_terms"]


class PlannerTerm(Protocol):
    """One package's contribution to a rank's estimate (see the module docstring)."""

    def memory(self, facts: Any) -> list[tuple[str, int, str]]:
        """Lines of the rank's peak: (name, bytes, note; "" for none), in print order."""
        ...

    def buffers(self, facts: Any) -> dict[str, int]:
        """Collective buffers held at the peak, by mechanism (summed into one line)."""
        ...

    def collectives(self, facts: Any) -> list[Collective]:
        """The collectives the rank issues per optimizer step (`automodel_mesh.Collective`)."""
        ...

    def traffic(self, facts: Any) -> float:
        """Bytes per step the term's own kernels read and write in device memory, beyond the model's ops.

        The time model spreads them over the step's passes.
        """
        ...


@dataclass(frozen=True)
class ActivationMemory:
    """What the rank's blocks, embedding and head save for backward (`activation_bytes`)."""

    profile: ActivationProfile
    strategy: StrategyMemory
    """The strategy decides what is recomputed and how tensor parallelism shards the activations."""
    compiled_loss: bool = False
    """Whether the loss is compiled (`PlanInput.compiled_loss`)."""
    pipeline: Any = None
    """The pipeline's term (``automodel_pipelining.memory.PipelineMemory``), or None."""

    def memory(self, facts: RankFacts) -> list[tuple[str, int, str]]:
        """One line: the activations at the rank's peak in backward."""
        tp, cp = facts.layout.tp, facts.layout.cp
        sp = self.strategy.sequence_parallel and tp > 1
        mode = self.strategy.checkpointing
        size = activation_bytes(
            self.profile,
            checkpointing=mode,
            blocks=[b for b in facts.blocks if b < len(self.profile.blocks)],
            in_flight=facts.in_flight,
            tp=tp,
            sequence_parallel=sp,
            first_stage=facts.first_stage,
            last_stage=facts.last_stage,
            compiled_loss=self.compiled_loss,
        )
        size -= self._freed_before_gradients(facts)
        note = (
            f"{len(facts.blocks)} block(s), {mode or 'no'} checkpointing, {facts.in_flight:g} "
            f"micro-batch(es) in flight, {facts.tokens} tokens/micro-batch, tp={tp}{' +SP' if sp else ''}, "
            f"cp={cp}"
        )
        return [("activations", size, note)]

    def _freed_before_gradients(self, facts: RankFacts) -> int:
        """Activations a looped pipeline schedule frees before its earlier stages' gradients exist.

        The strategy's accumulated gradients and these activations are lines of their own, each at
        its peak; a rank running several stages does not hold both peaks at once (the later stage's
        backward frees its activations, and reduces its gradients, before the earlier stage's
        backward makes its own: `automodel_pipelining.schedules.peak_with_gradients`). Each stage's
        gradients are taken in proportion to its blocks. 0 for one stage per rank.
        """
        stages = facts.stage_blocks
        if self.pipeline is None or len(stages) < 2 or not facts.accumulated:
            return 0
        if not self.strategy.deferred(facts.accumulation):
            return 0
        tp = facts.layout.tp
        sp = self.strategy.sequence_parallel and tp > 1
        mode = self.strategy.checkpointing
        held = [
            held_per_microbatch(self.profile, checkpointing=mode, blocks=s, tp=tp, sequence_parallel=sp)
            for s in stages
        ]
        blocks = sum(len(s) for s in stages)
        gradients = [facts.accumulated * len(s) / blocks for s in stages]
        together = self.pipeline.held_with_gradients(facts.index, held, gradients)
        return max(int(facts.in_flight * sum(held) + facts.accumulated - together), 0)

    def buffers(self, facts: RankFacts) -> dict[str, int]:
        """None: activations are not collective buffers."""
        del facts
        return {}

    def traffic(self, facts: RankFacts) -> float:
        """None of its own: the model's ops are the time model's compute."""
        del facts
        return 0.0

    def collectives(self, facts: RankFacts) -> list[Collective]:
        """None."""
        del facts
        return []


def pipeline_term(plan: PlanInput) -> Any:
    """``automodel_pipelining.memory.PipelineMemory`` of the job, or None without pipelining."""
    if plan.pipeline is None:
        return None
    from automodel_pipelining.memory import PipelineMemory

    layers = plan.config_int("num_hidden_layers")
    stages = plan.pipeline.stage_count(plan.layout.pp, layers) or plan.layout.pp
    return PipelineMemory(plan.pipeline, plan.layout.pp, stages)


def _strategy_term(plan: PlanInput) -> StrategyMemory:
    experts_reshard, root_is_fsdp = None, True
    if plan.layout.ep > 1:
        from automodel_moe.config import MoEParallelizerConfig

        moe = plan.moe or MoEParallelizerConfig()
        experts_reshard, root_is_fsdp = moe.reshard_after_forward, moe.wrap_outer_model
    stage = None
    if plan.pipeline is not None:
        stage = StageSync.for_stage(
            root_is_fsdp=root_is_fsdp,
            defer=getattr(plan.strategy, "defer_fsdp_grad_sync", True),
            patch_nested=plan.pipeline.patch_stage_backward_maybe_with_nosync,
        )
    setting, pipelined = reshard_setting(plan.strategy, experts_reshard), plan.pipeline is not None
    gathered = plan.model_fact(  # a function of the model and the two settings
        f"units gathered in backward {setting} {pipelined}",
        lambda: units_gathered_in_backward(
            plan.model, reshard_after_forward=setting, pipelined=pipelined, blocks=decoder_blocks(plan)
        ),
    )
    styled = tp_styled(plan) if plan.layout.tp > 1 else None
    tensor_parallel = (
        plan.model_fact(
            f"tp collectives {tp_plan_key(plan)}",
            lambda: tp_plan_collectives(plan.model, styled, decoder_blocks(plan)),
        )
        if styled is not None
        else None
    )
    return StrategyMemory.for_job(
        plan.strategy,
        stage=stage,
        experts_reshard=experts_reshard,
        backward_gathered=gathered,
        tensor_parallel=tensor_parallel,
    )


def planner_terms(plan: PlanInput, profile: ActivationProfile, pipeline: Any) -> list[PlannerTerm]:
    """The terms of ``plan``, in the order their lines print (the strategy's first)."""
    strategy = _strategy_term(plan)
    terms: list[PlannerTerm] = [strategy, ActivationMemory(profile, strategy, plan.compiled_loss, pipeline)]
    if plan.peft is not None:
        from automodel_peft.memory import LoRAMemory

        terms.append(LoRAMemory(plan.peft.dim, plan.peft.dropout))
    if plan.fp8 is not None and plan.fp8.enabled:
        from automodel_quant.memory import FP8Memory

        terms.append(FP8Memory())
    if pipeline is not None:
        terms.append(pipeline)
    if plan.layout.ep > 1:
        from automodel_moe.memory import ExpertExchange, ExpertMemory

        terms.append(ExpertMemory(plan.layout.ep, plan.expert_exchange or ExpertExchange()))
    return terms
