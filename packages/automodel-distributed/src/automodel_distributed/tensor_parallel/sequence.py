"""Sequence parallelism for any decoder: a sequence-sharded residual stream between the decoder blocks.

Two ways of keeping the activations of a transformers decoder sequence-sharded over the TP ranks:

- **Registered Megatron-style plans** (`automodel_distributed.tensor_parallel.plans`): the norms run on
  sequence slices, attention and MLP all-gather their input and their row-parallel projections
  reduce-scatter their output. Same communication volume as plain TP (an all-reduce is a reduce-scatter
  plus an all-gather); every activation outside attention and the MLP is stored sharded.
- **Derived from any TP plan** (`sequence_parallel_blocks`): each decoder block all-gathers its
  sequence-sharded input, runs exactly as under plain TP, and hands on only its own slice of the output.
  It needs nothing but the list of blocks, so it is exact for every model TP is exact for, whatever the
  blocks compute. It stores the stream between blocks sharded (what activation checkpointing keeps per
  block), but inside a block the activations are as large as under plain TP. Cost: one all-gather of the
  block input per block in the forward, and one all-gather of the output gradient in the backward
  (slicing is free), on top of TP's two all-reduces.

Both keep everything before the first block at full length: the input embedding hands on its full
(all-reduced) output, so the attention masks, position ids and rotary tables transformers builds from it
cover the whole sequence, and padding masks, eager attention and implicit position ids work. The first
block cuts the stream (`SequenceShardedBlock`). After the last block the derived form hands on the full
stream again (the final norm and the LM head run as under TP); a Megatron plan keeps it sharded into its
sequence-parallel final norm and LM head.

A `SequenceLength` recorded by a forward pre-hook on the model tells the block hooks the full length,
so that a block knows whether its input is the full stream or a slice, in whatever order the model calls
its blocks. Mesh axis: ``tp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "SequenceLength",
    "SequenceShardedBlock",
    "install_sequence_length",
    "sequence_parallel_blocks",
]

_SEQUENCE_DIM = 1


@dataclass
class SequenceLength:
    """The full sequence length of the batch in flight, recorded by `install_sequence_length`'s hook."""

    value: int | None = None


def _gather(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """All-gather a sequence slice; the backward hands each rank its slice of the (replicated) gradient."""
    full = DTensor.from_local(x, mesh, [Shard(_SEQUENCE_DIM)], run_check=False)
    return full.redistribute(placements=[Replicate()]).to_local()


def _cut(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of a replicated tensor (no communication); the backward all-gathers the gradient."""
    full = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return full.redistribute(placements=[Shard(_SEQUENCE_DIM)]).to_local()


class SequenceShardedBlock(ParallelStyle):
    """A decoder block on the sequence-sharded residual stream (see the module docstring).

    The stream is the block's first positional tensor or its ``hidden_states`` keyword; the output is the
    block's tensor output or the first element of a tuple or list. Parameters are left alone.

    Args:
        length: The full length of the batch in flight (shared by every block of the model).
        gather_input: All-gather an input that is a sequence slice (derived sequence parallelism).
        cut_input: Cut an input that is the full sequence to this rank's slice (the first block of a
            Megatron-style plan, whose norms expect a slice).
        cut_output: Cut a full-length output to this rank's slice (every block but the last, derived).
    """

    def __init__(
        self, length: SequenceLength, *, gather_input: bool, cut_input: bool, cut_output: bool
    ) -> None:
        super().__init__()
        self.length = length
        self.gather_input = gather_input
        self.cut_input = cut_input
        self.cut_output = cut_output

    def _full(self) -> int:
        if self.length.value is None:
            raise RuntimeError(
                "SequenceShardedBlock ran before the model's sequence-length hook: call the model itself, "
                "not its blocks, under sequence parallelism"
            )
        return self.length.value

    def _stream_in(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        full, size = self._full(), mesh.size()
        if self.gather_input and x.shape[_SEQUENCE_DIM] * size == full and size > 1:
            return _gather(x, mesh)
        if self.cut_input and x.shape[_SEQUENCE_DIM] == full:
            return _cut(x, mesh)
        return x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(
            _mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args and isinstance(args[0], torch.Tensor):
                return (self._stream_in(args[0], device_mesh), *args[1:]), kwargs
            value = kwargs.get("hidden_states")
            if isinstance(value, torch.Tensor):
                return args, {**kwargs, "hidden_states": self._stream_in(value, device_mesh)}
            raise ValueError(
                f"sequence parallelism: decoder block {type(_mod).__name__} was called without its hidden "
                "states (neither a positional tensor nor the keyword 'hidden_states')"
            )

        def post_hook(_mod: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
            if not self.cut_output:
                return output
            full = self._full()
            if isinstance(output, torch.Tensor):
                return _cut(output, device_mesh) if output.shape[_SEQUENCE_DIM] == full else output
            if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
                first = output[0]
                if first.shape[_SEQUENCE_DIM] == full:
                    cut = [_cut(first, device_mesh), *output[1:]]
                    return tuple(cut) if isinstance(output, tuple) else cut
                return output
            raise ValueError(
                f"sequence parallelism: decoder block {type(_mod).__name__} returned "
                f"{type(output).__name__}; expected its hidden states (a tensor, or a tuple or list starting "
                "with one)"
            )

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(gather_input={self.gather_input}, cut_input={self.cut_input}, "
            f"cut_output={self.cut_output})"
        )


def sequence_parallel_blocks(
    block_fqns: Sequence[str], length: SequenceLength, *, megatron: bool
) -> dict[str, ParallelStyle]:
    """Plan entries that put ``block_fqns`` (in forward order) on the sequence-sharded stream.

    Args:
        block_fqns: The decoder blocks, in the order the model calls them.
        length: Shared by the entries and the model's `install_sequence_length` hook.
        megatron: The blocks follow a Megatron-style plan (their insides take and give slices): only the
            full-length input of the first block is cut. Otherwise every block gathers its input and
            every block but the last cuts its output.

    Returns:
        ``{block fqn: SequenceShardedBlock}``.
    """
    entries: dict[str, ParallelStyle] = {}
    last = len(block_fqns) - 1
    for index, fqn in enumerate(block_fqns):
        if megatron:
            entries[fqn] = SequenceShardedBlock(length, gather_input=False, cut_input=True, cut_output=False)
        else:
            entries[fqn] = SequenceShardedBlock(
                length, gather_input=True, cut_input=False, cut_output=index != last
            )
    return entries


def install_sequence_length(model: nn.Module, length: SequenceLength, tp_size: int) -> None:
    """Record each batch's full sequence length on ``length`` before ``model`` runs; check it divides.

    Raises (at call time):
        ValueError: Neither ``input_ids`` nor ``inputs_embeds`` is given, or the sequence length does not
            divide by ``tp_size``.
    """

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        x = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(
                "sequence parallelism needs input_ids or inputs_embeds of shape [batch, sequence, ...]"
            )
        if x.shape[_SEQUENCE_DIM] % tp_size:
            raise ValueError(
                f"sequence parallelism over tp_size={tp_size} needs a sequence length divisible by it, got "
                f"{x.shape[_SEQUENCE_DIM]}; pad the batch to a multiple of {tp_size}"
            )
        length.value = int(x.shape[_SEQUENCE_DIM])

    model.register_forward_pre_hook(hook, with_kwargs=True)
