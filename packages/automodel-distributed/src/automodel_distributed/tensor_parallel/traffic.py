"""The activation collectives a tensor-parallel plan issues in one forward and one backward.

Read from the plan's own styles (what `parallelize_module` applies), each collective moving one
activation, a layer's input or output (``tokens x`` its width):

- a column-parallel layer whose input is a sequence slice (``input_layouts`` ``Shard``) all-gathers it
  in forward and reduce-scatters its gradient in backward; one whose replicated input comes from a
  `GatherSequenceInput` or `ReplicateBlockInput` around it issues nothing (that style hands the input on
  as a DTensor and reduces the summed gradients of every projection it feeds); any other all-reduces its
  input gradient in backward (DTensor makes the ``Partial`` sum whole for the replicated input, one
  projection at a time);
- a row-parallel layer all-reduces its output in forward, or reduce-scatters it to a sequence slice
  and all-gathers the slice's gradient in backward;
- `GatherSequenceInput` all-gathers its block's input and reduce-scatters the gradient;
  `ReplicateBlockInput` all-reduces the gradient;
- `SequenceShardedBlock` cuts the full-length stream of the first block to this rank's slice (its
  backward all-gathers the gradient; counted before the blocks, where the stream enters the
  sequence-parallel region), gathers a sliced input (every block but the first; the gradient of the
  gathered input is replicated, so the backward only slices it) and cuts a full-length output (every
  block but the last) where a derived plan asks it to;
- a column-parallel output head that keeps its logits sharded (``use_local_output=False``: torch's
  ``loss_parallel``) adds the loss's three all-reduces of one fp32 value per token (the logits' max,
  the sum of their exponentials, the target's logit).

Replicated parameters whose gradient each rank computes from its own slice (a norm's under
`SequenceParallel`, a per-head norm's under `ReplicatedWithGradAllReduce`, a row-parallel bias added to
a sequence slice) hold a ``Partial`` gradient that DTensor all-reduces once per step, when FSDP's
reduction or the optimizer reads it (`PassCollectives.partial_grads`). Left out: the styles of other
mechanisms (expert parallelism's). Nothing here runs a collective.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from automodel_distributed.tensor_parallel.sequence import SequenceShardedBlock
from automodel_distributed.tensor_parallel.styles import (
    GatherSequenceInput,
    ReplicateBlockInput,
    ReplicatedWithGradAllReduce,
)

__all__ = ["LOSS_PARALLEL_REDUCTIONS", "PassCollectives", "TPCollectives", "plan_collectives"]

LOSS_PARALLEL_REDUCTIONS = 3
"""All-reduces of one fp32 value per token that torch's ``loss_parallel`` cross entropy runs in forward."""


@dataclass
class PassCollectives:
    """A part of the model's activation collectives in one forward and one backward, by kind.

    Kinds: ``all_gather``, ``reduce_scatter``, ``all_reduce``. ``loss_reductions``: the per-token fp32
    all-reduces of a vocab-parallel loss.
    """

    forward: Counter[str] = field(default_factory=Counter)
    """Kind -> collectives in one forward."""
    backward: Counter[str] = field(default_factory=Counter)
    """Kind -> collectives in one backward."""
    forward_width: Counter[str] = field(default_factory=Counter)
    """Kind -> their values per token, summed (a layer's input or output width: a LoRA adapter's rank
    for its thin matmuls, the model's width for the rest)."""
    backward_width: Counter[str] = field(default_factory=Counter)
    loss_reductions: int = 0
    partial_grads: list[int] = field(default_factory=list)
    """Elements of each replicated parameter whose gradient is a ``Partial`` sum (a norm's under
    sequence parallelism, a per-head norm's), all-reduced over the TP ranks once per step."""

    def add(self, phase: str, kind: str, width: int) -> None:
        """Count one collective of ``width`` values per token in ``phase`` (``forward`` or ``backward``)."""
        getattr(self, phase)[kind] += 1
        getattr(self, f"{phase}_width")[kind] += width


class TPCollectives(NamedTuple):
    """A plan's collectives (`plan_collectives`)."""

    blocks: dict[int, PassCollectives]
    """Per decoder block index; a block without collectives is absent."""
    entry: PassCollectives
    """Before the blocks (the embedding, the stream entering the sequence-parallel region)."""
    exit: PassCollectives
    """After the blocks (the final norm, the output head, the loss)."""


def plan_collectives(
    model: nn.Module,
    styled: Sequence[tuple[str, nn.Module, ParallelStyle]],
    blocks: Mapping[str, int],
    hidden: int,
) -> TPCollectives:
    """The collectives of a plan on ``model``: per decoder block, before and after the blocks.

    Args:
        model: The model the plan applies to (any device; read only).
        styled: Every ``(fqn, module, style)`` the plan applies
            (`automodel_distributed.memory.tp_styled_modules`).
        blocks: FQN -> index of the decoder blocks
            (`automodel_distributed.memory.decoder_block_indices`).
        hidden: The model's width: the residual stream's, and that of a styled module whose own
            (a linear layer's ``in_features`` or ``out_features``) is unknown.
    """
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    first = min((order[fqn] for fqn in blocks if fqn in order), default=len(order))
    gathered = tuple(fqn + "." for fqn, _, style in styled if isinstance(style, GatherSequenceInput))
    out = TPCollectives({}, PassCollectives(), PassCollectives())
    last = max(blocks.values(), default=-1)
    for fqn, module, style in styled:
        index = _block_of(fqn, blocks)
        if index is None:
            part = out.entry if order[fqn] < first else out.exit
            _add_style(part, module, style, fqn.startswith(gathered), hidden)
        elif isinstance(style, SequenceShardedBlock):
            part = out.blocks.setdefault(index, PassCollectives())
            if style.cut_input and index == 0:  # where the stream enters the sequence-parallel region
                out.entry.add("backward", "all_gather", hidden)
            if style.gather_input and index > 0:  # its backward slices the replicated gradient: free
                part.add("forward", "all_gather", hidden)
            if style.cut_output and index < last:
                part.add("backward", "all_gather", hidden)
        else:
            part = out.blocks.setdefault(index, PassCollectives())
            _add_style(part, module, style, fqn.startswith(gathered), hidden)
    return out


def _block_of(fqn: str, blocks: Mapping[str, int]) -> int | None:
    """The index of the decoder block ``fqn`` is or lies in, None outside the blocks."""
    parts = fqn.split(".")
    for end in range(len(parts), 0, -1):
        index = blocks.get(".".join(parts[:end]))
        if index is not None:
            return index
    return None


def _add_style(
    part: PassCollectives, module: nn.Module, style: ParallelStyle, inside_gather: bool, hidden: int
) -> None:
    """Add one styled module's collectives to ``part`` (mutates it; see the module doc)."""
    if isinstance(style, ColwiseParallel):
        width = getattr(module, "in_features", hidden)
        if isinstance(style.input_layouts[0], Shard):
            part.add("forward", "all_gather", width)
            part.add("backward", "reduce_scatter", width)
        elif not inside_gather:
            part.add("backward", "all_reduce", width)
        if not style.use_local_output:
            part.loss_reductions += LOSS_PARALLEL_REDUCTIONS
    elif isinstance(style, RowwiseParallel):
        width = getattr(module, "out_features", getattr(module, "embedding_dim", hidden))
        if isinstance(style.output_layouts[0], Shard):
            part.add("forward", "reduce_scatter", width)
            part.add("backward", "all_gather", width)
            bias = getattr(module, "bias", None)  # replicated, added to this rank's slice of the output
            if isinstance(bias, nn.Parameter):
                part.partial_grads.append(bias.numel())
        else:
            part.add("forward", "all_reduce", width)
    elif isinstance(style, ReplicateBlockInput):
        part.add("backward", "all_reduce", hidden)
    elif isinstance(style, GatherSequenceInput):
        part.add("forward", "all_gather", hidden)
        part.add("backward", "reduce_scatter", hidden)
    elif isinstance(style, SequenceParallel | ReplicatedWithGradAllReduce):
        part.partial_grads.extend(p.numel() for p in module.parameters(recurse=False))
