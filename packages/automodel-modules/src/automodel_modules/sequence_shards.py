"""In how many sequence slices a model's hidden states travel between its blocks (sequence parallelism).

Sequence parallelism (``automodel_distributed.tensor_parallel.sequence``) keeps the residual stream
between the decoder blocks cut over the ``tp`` ranks and marks the module it is installed on; a pipeline
stage (``automodel_pipelining``) reads the mark, since what it receives from the previous stage and sends
to the next is then one rank's slice of the sequence, not the whole of it. A stage before the last
marks itself in turn (`mark_stream_continues`): its last block hands its slice on like any other block.
The contract lives here because neither package depends on the other.
"""

from __future__ import annotations

from torch import nn

__all__ = ["mark_sequence_shards", "mark_stream_continues", "sequence_shards", "stream_continues"]

_ATTR = "_automodel_sequence_shards"
_CONTINUES_ATTR = "_automodel_stream_continues"


def mark_sequence_shards(module: nn.Module, shards: int) -> None:
    """Record on ``module`` (mutated: one attribute) that its stream between blocks is cut in ``shards``."""
    assert shards >= 1, shards
    setattr(module, _ATTR, shards)


def sequence_shards(module: nn.Module) -> int:
    """Slices of the stream between ``module``'s blocks (1: the whole sequence; unmarked modules too)."""
    return int(getattr(module, _ATTR, 1))


def mark_stream_continues(module: nn.Module) -> None:
    """Record on ``module`` (mutated: one attribute) that another pipeline stage runs its later blocks."""
    setattr(module, _CONTINUES_ATTR, True)


def stream_continues(module: nn.Module) -> bool:
    """Whether ``module`` is a pipeline stage whose last block's output goes on to another stage."""
    return bool(getattr(module, _CONTINUES_ATTR, False))
