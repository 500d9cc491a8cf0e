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

The derived form is exact only if nothing outside the blocks reads a block's output before the next
block gathers it (a model that adds the stream to a full-length tensor between blocks, or feeds it to a
block as a second input, would see a slice): `check_sequence_stream` proves that from one forward on fake
tensors, before anything is sharded.
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
from torch.utils import _pytree as pytree

from automodel_modules import embedding_module, mark_sequence_shards

__all__ = [
    "SequenceLength",
    "SequenceShardedBlock",
    "check_sequence_stream",
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
    block_fqns: Sequence[str], length: SequenceLength, *, megatron: bool, last_cuts: bool = False
) -> dict[str, ParallelStyle]:
    """Plan entries that put ``block_fqns`` (in forward order) on the sequence-sharded stream.

    Args:
        block_fqns: The decoder blocks, in the order the model calls them.
        length: Shared by the entries and the model's `install_sequence_length` hook.
        megatron: The blocks follow a Megatron-style plan (their insides take and give slices): only the
            full-length input of the first block is cut. Otherwise every block gathers its input and
            every block but the last cuts its output.
        last_cuts: The last block cuts its output too (a pipeline stage before the last hands its slice to
            the next stage: `automodel_modules.stream_continues`).

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
                length, gather_input=True, cut_input=False, cut_output=index != last or last_cuts
            )
    return entries


_SLICE = "sequence slice"
_PROBE_LENGTH = 12
"""Length of the probe's sequence: divisible by small TP sizes, and no size of a tiny or real config, so
that a tensor as long as it is a full-length activation."""

_PER_POSITION_OPS = frozenset(
    {
        "add", "sub", "mul", "div", "true_divide", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "abs",
        "tanh", "sigmoid", "relu", "gelu", "silu", "softplus", "clamp", "where", "masked_fill",
        "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__",
        "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__neg__", "__pow__", "__rpow__",
        "add_", "mul_", "div_", "sub_", "to", "float", "half", "bfloat16", "type_as", "contiguous",
        "clone", "detach", "dropout", "linear", "layer_norm", "rms_norm", "__get__",
    }
)  # fmt: skip
"""Ops that compute each position from that position alone (elementwise, or over the feature dim)."""

_FEATURE_REDUCTIONS = frozenset(
    {"mean", "sum", "var", "std", "norm", "amax", "amin", "softmax", "log_softmax"}
)
"""Ops that are per position when reduced over the last (feature) dim only."""


def _stream_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The block input `SequenceShardedBlock` treats as the stream (first positional tensor, else keyword)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def _first_output(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _slice_read(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], labels_of: Any) -> str | None:
    """Why op ``op`` between the blocks, given a sequence slice, would compute something else; or None.

    Per-position ops on slices are exact (a norm, a residual add of two block outputs, a dtype cast);
    an op that mixes positions (a reduction over the sequence, indexing, a concatenation, a convolution)
    or that meets a full-length activation (an input injection from the embeddings) is not.
    """
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if op in _FEATURE_REDUCTIONS:
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
        ndim = tensors[0].dim() if tensors else 0
        dims = dims if isinstance(dims, tuple | list) else (dims,)
        if not all(isinstance(d, int) and d % max(ndim, 1) == ndim - 1 for d in dims):
            return f"'{op}' over the sequence between the blocks"
    elif op not in _PER_POSITION_OPS:
        return f"'{op}' between the blocks"
    full = [
        t
        for t in tensors
        if t.dim() > _SEQUENCE_DIM and t.shape[_SEQUENCE_DIM] == _PROBE_LENGTH and _SLICE not in labels_of(t)
    ]
    if full and op != "linear":  # a linear's weight is no activation
        return f"'{op}' of a block's output with a full-length tensor between the blocks"
    return None


def _tolerant_forward(forward: Any) -> Any:
    """A block's ``forward`` for the probe of `check_sequence_stream`.

    When the block's own values decide its control flow (an MoE loop over the experts hit), it stands in
    as a tensor shaped like its stream: what the check reads is the code between the blocks.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException):
            stream = _stream_of(args, kwargs)
            if stream is None:
                raise
            return torch.empty_like(stream)

    return run


def check_sequence_stream(model: nn.Module, block_fqns: Sequence[str]) -> None:
    """Refuse a model whose code outside its decoder blocks would read a sequence slice (derived SP).

    One forward of the transformers model on fake tensors (`automodel_modules.dataflow`; no compute, no
    memory, meta models included) labels what derived sequence parallelism would cut: the first output of
    every block but the last, when it is as long as the sequence. A block's input is gathered, so
    everything a block computes is full length again; what is recorded is every op outside the blocks
    that reads a labelled tensor (a residual added between blocks, a concatenation with full-length
    states, a recurrence that mixes block outputs) and every block that gets one other than as its
    stream. Any of these would see a slice where it expects the whole sequence. A block whose own values
    decide its control flow (an MoE loop over the experts hit) stands in as a tensor shaped like its
    stream: its insides run on the gathered stream anyway.

    Args:
        model: The model to shard (unchanged; the probe's hooks are removed).
        block_fqns: The decoder blocks, as `sequence_parallel_blocks` gets them.

    Raises:
        ValueError: Such a read exists, or the forward does not run on fake tensors (so that the derived
            form cannot be shown to be exact); the message says to use ``sequence_parallel=False``.
    """
    from automodel_modules import find_hf_model, unwrap
    from automodel_modules.dataflow import DataFlow, fake_forward

    _, hf = find_hf_model(unwrap(model))
    name = type(hf).__name__
    blocks = [model.get_submodule(fqn) for fqn in block_fqns]
    last = blocks[-1] if blocks else None
    depth = [0]
    reads: set[str] = set()

    def on_op(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], labels_of: Any) -> None:
        if depth[0] or _SLICE not in labels_of((args, kwargs)):
            return
        why = _slice_read(op, args, kwargs, labels_of)
        if why:
            reads.add(why)

    flow = DataFlow(on_op)

    def unlabel(value: Any) -> None:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                flow.set(leaf, flow.labels_of(leaf) - {_SLICE})

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if depth[0] == 0:
            stream = _stream_of(args, kwargs)
            others = [a for a in (*args, *kwargs.values()) if a is not stream]
            if _SLICE in flow.labels_of(others):
                reads.add(f"{type(module).__name__} given a block's output besides its stream")
        depth[0] += 1

    def post_hook(module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        depth[0] -= 1
        if depth[0]:
            return
        unlabel(output)  # computed from the gathered (full) stream
        first = _first_output(output)
        if module is not last and first is not None and first.shape[_SEQUENCE_DIM] == _PROBE_LENGTH:
            flow.set(first, flow.labels_of(first) | {_SLICE})

    handles = [h for b in blocks for h in (
        b.register_forward_pre_hook(pre_hook, with_kwargs=True), b.register_forward_hook(post_hook)
    )]  # fmt: skip
    for block in blocks:
        block.forward = _tolerant_forward(block.forward)  # instance attribute: hooks still run
    param = next(hf.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    try:
        with fake_forward(flow, data_dependent_shapes=True):
            hf(**_probe_inputs(hf, device), use_cache=False)
    except Exception as exc:
        raise ValueError(
            f"sequence parallelism cannot check {name}: its forward does not run on fake tensors "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); use "
            "sequence_parallel=False for it"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
        for block in blocks:
            del block.forward
    if reads:
        raise ValueError(
            f"sequence parallelism cannot shard {name}: its forward reads the residual stream outside its "
            f"decoder blocks ({'; '.join(sorted(reads))}), where each rank would hold only a slice of the "
            "sequence; use sequence_parallel=False for it"
        )


def _probe_inputs(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Token ids, or activations for a model whose input embedding holds no weights.

    A later pipeline stage (``automodel_pipelining``) keeps a parameter-free stand-in for the embedding
    its first stage owns and takes the previous stage's activations instead of token ids.
    """
    embedding = embedding_module(model, "input")
    if embedding is not None and next(embedding.parameters(), None) is not None:
        return {"input_ids": torch.zeros(1, _PROBE_LENGTH, dtype=torch.long, device=device)}
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(hidden, int):
        raise ValueError("a model without input embedding weights needs config.hidden_size to be probed")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {"inputs_embeds": torch.zeros(1, _PROBE_LENGTH, hidden, dtype=dtype, device=device)}


def install_sequence_length(model: nn.Module, length: SequenceLength, tp_size: int) -> None:
    """Record each batch's full sequence length on ``length`` before ``model`` runs; check it divides.

    Also marks ``model`` as cutting its stream in ``tp_size`` slices (`automodel_modules.sequence_shards`).

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
        if isinstance(ids, torch.Tensor) and ids.is_floating_point():
            # A pipeline stage's received activations (`automodel_pipelining`): this rank's slice of the
            # stream its previous stage cut.
            length.value = int(ids.shape[_SEQUENCE_DIM]) * tp_size
            return
        if x.shape[_SEQUENCE_DIM] % tp_size:
            raise ValueError(
                f"sequence parallelism over tp_size={tp_size} needs a sequence length divisible by it, got "
                f"{x.shape[_SEQUENCE_DIM]}; pad the batch to a multiple of {tp_size}"
            )
        length.value = int(x.shape[_SEQUENCE_DIM])

    model.register_forward_pre_hook(hook, with_kwargs=True)
    mark_sequence_shards(model, tp_size)  # a pipeline stage sends and receives slices (`sequence_shards`)
