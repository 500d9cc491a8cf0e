"""The pipeline's share of a rank's memory and traffic, for planners (``automodel_planner``).

Which blocks each pipeline rank runs (`rank_blocks`: the split `AutoPipeline` makes, looped over the
ranks), how many micro-batches' activations a rank holds at its peak (`in_flight_microbatches` of the
schedule), and `PipelineMemory`: the stage's receive buffers and its point-to-point traffic. Pure
arithmetic over a meta model; no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from automodel_mesh import Collective, Overlap
from automodel_pipelining.config import PipelineConfig
from automodel_pipelining.costs import read_stage_costs
from automodel_pipelining.layout import resolve_decoder_layout
from automodel_pipelining.schedules import in_flight_microbatches, peak_with_gradients, resolve_schedule
from automodel_pipelining.split import split_layers_evenly

__all__ = ["PipelineFacts", "PipelineMemory", "rank_blocks", "rank_stage_blocks", "stage_layer_counts"]


def stage_layer_counts(model: nn.Module, config: PipelineConfig, num_layers: int, stages: int) -> list[int]:
    """Layers per stage as `AutoPipeline` splits them (by cost with ``balance_stages``, else evenly)."""
    if config.balance_stages and 1 <= stages <= num_layers:
        return read_stage_costs(model, resolve_decoder_layout(model)).layer_counts(stages)
    return split_layers_evenly(num_layers, stages)


def rank_stage_blocks(counts: Sequence[int], pp_size: int) -> list[list[list[int]]]:
    """Each pipeline rank's stages, in order, as block indices (stage ``s`` on rank ``s % pp_size``).

    ``counts[s]`` is the number of layers of stage ``s``.
    """
    owned: list[list[list[int]]] = [[] for _ in range(pp_size)]
    layer = 0
    for stage, count in enumerate(counts):
        owned[stage % pp_size].append(list(range(layer, layer + count)))
        layer += count
    return owned


def rank_blocks(counts: Sequence[int], pp_size: int) -> list[list[int]]:
    """Block indices of each pipeline rank (its stages' blocks together, `rank_stage_blocks`)."""
    return [[b for stage in stages for b in stage] for stages in rank_stage_blocks(counts, pp_size)]


class PipelineFacts(Protocol):
    """What `PipelineMemory` reads of a planner's per-rank facts."""

    index: int
    """The pipeline rank."""
    first_stage: bool
    last_stage: bool
    tokens: int
    """Tokens per micro-batch on the rank."""
    sequence_shards: int
    """Slices of the sequence a stage sends and receives (``tp`` under sequence parallelism)."""
    hidden_size: int
    element_size: int


@dataclass(frozen=True)
class PipelineMemory:
    """A pipeline's receive buffers and point-to-point traffic on each rank (a planner term).

    Args:
        config: The pipeline config (batch sizes filled in).
        pp_size: Pipeline ranks.
        stages: Stages in all (``config.stage_count``).
    """

    config: PipelineConfig
    pp_size: int
    stages: int

    @property
    def stages_per_rank(self) -> int:
        """Stages each rank runs (``v`` of a looped schedule)."""
        return max(self.stages // self.pp_size, 1)

    def in_flight(self, rank: int) -> float:
        """Micro-batches of its blocks' activations rank ``rank`` holds at once, per stage it runs."""
        spec = resolve_schedule(self.config.pp_schedule, self.config.pp_schedule_csv)
        held = in_flight_microbatches(
            spec,
            pp_size=self.pp_size,
            rank=rank,
            n_microbatches=self.config.n_microbatches,
            stages_per_rank=self.stages_per_rank,
        )
        return held / self.stages_per_rank

    def held_with_gradients(
        self, rank: int, activations: Sequence[float], gradients: Sequence[float]
    ) -> float:
        """The most rank ``rank`` holds at once of its stages' activations and gradients.

        ``activations[c]``: one micro-batch's of its stage ``c``; ``gradients[c]``: that stage's
        accumulated unsharded gradients (`peak_with_gradients`).
        """
        return peak_with_gradients(
            resolve_schedule(self.config.pp_schedule, self.config.pp_schedule_csv),
            pp_size=self.pp_size,
            rank=rank,
            n_microbatches=self.config.n_microbatches,
            activations=activations,
            gradients=gradients,
        )

    @staticmethod
    def _activation_bytes(facts: PipelineFacts) -> int:
        """One micro-batch's activations between two stages (this rank's slice under SP)."""
        return facts.tokens // facts.sequence_shards * facts.hidden_size * facts.element_size

    def memory(self, facts: PipelineFacts) -> list[tuple[str, int, str]]:
        """No lines of its own: the activations it keeps in flight are the activation term's."""
        del facts
        return []

    def buffers(self, facts: PipelineFacts) -> dict[str, int]:
        """The stage's receive buffers, made once by torch's ``PipelineStage``: one per micro-batch.

        Forward inputs on every stage but the first, backward gradients on every stage but the last,
        for each of the rank's stages.
        """
        size = self._transfers(facts) * self.config.n_microbatches * self._activation_bytes(facts)
        return {"PP receive buffers": size}

    def _transfers(self, facts: PipelineFacts) -> int:
        """Tensors the rank receives per micro-batch over its stages, and sends as many.

        Forward activations on every stage but the first, backward gradients on every stage but the last.
        """
        return 2 * self.stages_per_rank - (1 if facts.first_stage else 0) - (1 if facts.last_stage else 0)

    def traffic(self, facts: PipelineFacts) -> float:
        """None beyond the model's ops."""
        del facts
        return 0.0

    def collectives(self, facts: PipelineFacts) -> list[Collective]:
        """Activations sent forward and gradients sent back, per micro-batch, by each of the rank's stages.

        A rank sends as many tensors as it receives: every stage but the last sends its output forward,
        every stage but the first its input's gradient back.
        """
        size = self._transfers(facts) * self._activation_bytes(facts)
        return [Collective("PP send/recv", "pp", size, self.config.n_microbatches, Overlap.EXPOSED, "p2p")]
