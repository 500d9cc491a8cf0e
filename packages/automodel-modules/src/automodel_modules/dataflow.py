"""Trace what tensors are computed from, on one forward of fake tensors: structure read from the model.

`DataFlow` is a ``TorchFunctionMode`` that labels tensors by what they were computed from (labels are set
on some tensors, the embedding's output say, and every op's outputs inherit the labels of its inputs)
and can tell a callback about every op. Run under ``FakeTensorMode`` (`fake_forward`), a forward costs no
compute and no memory, meta-device models included; transformers skips its data-dependent checks on fake
tensors. The pipeline splitter (`automodel_pipelining.probe`) and the context-parallel check
(`automodel_distributed.context_parallel`) read the model's own code this way instead of relying on
per-family knowledge.

What carries no label: ops that read only a tensor's shape, dtype or device (``zeros_like``,
``new_empty``, ``size``, ``x.to(other)``'s ``other``), and the index argument of an indexing op (which
rows are read is not a value that flows into them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from automodel_modules.fake_mode import fake_mode

__all__ = ["DataFlow", "OpCallback", "fake_forward"]

OpCallback = Callable[[str, tuple[Any, ...], dict[str, Any], Callable[[Any], frozenset[str]]], None]
"""``fn(op name, args, kwargs, labels_of)``, called before each op with the labels of its arguments."""

# Ops whose result depends on a tensor's shape, dtype or device only, never on its values.
_VALUE_FREE = frozenset(
    {
        "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
        "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
        "size", "dim", "numel", "stride", "element_size", "is_floating_point", "is_complex",
        "__len__", "get_device", "type",
    }
)  # fmt: skip

# Ops whose other tensor arguments give only a dtype, a device or a shape (``x.to(other)``), or the
# positions to read (``x[index]``, ``x.gather(dim, index)``): only the first argument's values flow.
_SELF_ONLY = frozenset(
    {"to", "type_as", "expand_as", "view_as", "reshape_as", "__getitem__", "index_select", "gather",
     "take", "take_along_dim", "embedding"}
)  # fmt: skip


def _in_place(name: str) -> bool:
    """``add_``, ``masked_fill_``, ``__iadd__``, ``__setitem__``: ops that write into their first argument."""
    if name.startswith("__"):
        return name.startswith("__i") or name == "__setitem__"
    return name.endswith("_")


class DataFlow(TorchFunctionMode):
    """Labels every tensor an op computes with the labels of the tensors it computed it from.

    Args:
        on_op: Called before every op (see `OpCallback`).
    """

    def __init__(self, on_op: OpCallback | None = None) -> None:
        super().__init__()
        self.on_op = on_op
        self._labels: dict[int, frozenset[str]] = {}
        self._alive: list[torch.Tensor] = []  # keeps labelled tensors alive so their ids stay theirs

    def labels_of(self, value: Any) -> frozenset[str]:
        """The union of the labels of every tensor in ``value`` (a tensor, or any nest of them)."""
        found: set[str] = set()
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found |= self._labels.get(id(leaf), frozenset())
        return frozenset(found)

    def set(self, value: Any, labels: Iterable[str]) -> None:
        """Give every tensor of ``value`` exactly ``labels``."""
        labels = frozenset(labels)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self._labels[id(leaf)] = labels
                self._alive.append(leaf)

    def _add(self, value: Any, labels: frozenset[str]) -> None:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self._labels[id(leaf)] = self._labels.get(id(leaf), frozenset()) | labels
                self._alive.append(leaf)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.on_op is not None:
            self.on_op(name, args, kwargs, self.labels_of)
        out = func(*args, **kwargs)
        if name not in _VALUE_FREE:
            labels = self.labels_of(args[:1]) if name in _SELF_ONLY else self.labels_of((args, kwargs))
            if labels:
                self._add(out, labels)
                if _in_place(name) and args:  # the first argument now holds the result
                    self._add(args[0], labels)
        return out


@contextlib.contextmanager
def fake_forward(flow: DataFlow, *, data_dependent_shapes: bool = False) -> Iterator[None]:
    """Run the block under ``FakeTensorMode`` (non-fake parameters allowed) and ``flow``, without grad.

    Args:
        flow: The labelling mode to run under.
        data_dependent_shapes: Give the fake mode a ``ShapeEnv``, so that ops whose output size depends
            on values (``nonzero`` in an MoE dispatch, ``item``) produce unbacked sizes instead of
            raising; Python control flow on such a value still raises.
    """
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv() if data_dependent_shapes else None
    with fake_mode(allow_non_fake_inputs=True, shape_env=shape_env), flow, torch.no_grad():
        yield
