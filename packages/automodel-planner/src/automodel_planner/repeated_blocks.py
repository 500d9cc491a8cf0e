"""Blocks that repeat an earlier one, so a profile runs each kind of block twice, not every block.

A 405B Llama has 126 identical blocks; the fake forward that profiles a step (`activations.profile_step`)
spends nearly all its time dispatching their ops. Blocks are the same kind when their modules are: the
same classes, parameter shapes and dtypes, and the same plain attributes (``sliding_window``,
``attention_type``, ``is_sliding``: the per-layer choices transformers makes when it builds a layer),
``layer_idx`` aside. The first two blocks of each kind run (the second sees what every later one sees:
a block's output as its input); every later one of that kind returns new tensors of the second's
output shapes without running, and the profile gives it the second's counts. The counts are those of
the full forward (``tests/unit/test_repeated_blocks.py`` compares them over families with mixed
layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

__all__ = ["repeated_blocks", "skip_repeated"]

_PLAIN = (int, float, str, bool, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _kind(block: nn.Module) -> tuple[Any, ...]:
    """What ``block`` computes by: its modules' classes, parameters and plain attributes."""
    kind = []
    for name, module in block.named_modules():
        attributes = tuple(
            sorted(
                (key, repr(value))
                for key, value in vars(module).items()
                if not key.startswith("_") and key != "layer_idx" and _plain(value)
            )
        )
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        parameters = tuple((key, tuple(t.shape), t.dtype) for key, t in tensors)
        kind.append((name, type(module), attributes, parameters))
    return tuple(kind)


def _like(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor like ``tensor`` that, like a block's output, requires grad when it does."""
    return torch.empty_like(tensor).requires_grad_(tensor.requires_grad)


def repeated_blocks(blocks: Sequence[tuple[str, nn.Module]]) -> dict[int, int]:
    """Each block that need not run -> the block whose counts it takes (the second of its kind)."""
    seen: dict[tuple[Any, ...], list[int]] = {}
    copies: dict[int, int] = {}
    for index, (_, block) in enumerate(blocks):
        runs = seen.setdefault(_kind(block), [])
        if len(runs) < 2:
            runs.append(index)
        else:
            copies[index] = runs[1]
    return copies


class _ForwardRestore:
    """A handle whose ``remove()`` gives a block back the ``forward`` it had (its own, or its class's)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.previous = block.__dict__.get("forward")

    def remove(self) -> None:
        if self.previous is None:
            self.block.__dict__.pop("forward", None)
        else:
            self.block.forward = self.previous


def skip_repeated(blocks: Sequence[tuple[str, nn.Module]], copies: dict[int, int]) -> list[Any]:
    """Make each block of ``copies`` return its model's output without running (mutates the blocks).

    Returns the handles to remove (``remove()`` each): the forward hooks, and one per skipped block that
    drops its replaced ``forward``, so that one fake model serves several profiles.
    """
    outputs: dict[int, Any] = {}
    handles: list[Any] = []
    for source in set(copies.values()):

        def keep(module: nn.Module, args: Any, output: Any, source: int = source) -> None:
            outputs[source] = output

        handles.append(blocks[source][1].register_forward_hook(keep))
    for index, source in copies.items():

        def forward(*args: Any, source: int = source, **kwargs: Any) -> Any:
            # New tensors of the source's shapes: an op after the block (the final norm) that saves its
            # input must see a tensor no block has saved and that autograd tracks, as after a block that ran.
            return tree_map_only(torch.Tensor, _like, outputs[source])

        handles.append(_ForwardRestore(blocks[index][1]))
        blocks[index][1].forward = forward
    return handles
