"""Parallel styles: the string names a plan may use, and the few styles torch does not ship.

A plan maps module FQN patterns to `ParallelStyle` objects or to these names. Layout words: "local" means
the module hands on a plain tensor holding this rank's slice, "DTensor" means it hands on a DTensor;
"seq" is the sequence dim (1), "vocab" the last dim of the logits.

- ``colwise``: ``ColwiseParallel()``; replicated -> last dim sharded, local.
- ``colwise_rep``: ``ColwiseParallel(output_layouts=Replicate())``; replicated -> gathered.
- ``colwise_vocab``: ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``; replicated ->
  vocab-sharded DTensor (an LM head; compute the loss under ``loss_parallel()``).
- ``colwise_seq_rep``: ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``; seq-sharded
  -> gathered (an LM head with replicated logits under SP).
- ``colwise_seq_vocab``: ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
  use_local_output=False)``; seq-sharded -> vocab-sharded DTensor (the SP LM head).
- ``rowwise``: ``RowwiseParallel()``; last dim sharded, local -> all-reduced.
- ``rowwise_rep``: ``RowwiseParallel(input_layouts=Replicate())``; replicated -> all-reduced. On an
  ``nn.Embedding`` this is the vocab-parallel embedding.
- ``rowwise_seq``: ``RowwiseParallel(output_layouts=Shard(1))``; last dim sharded -> reduce-scattered on
  seq, local (SP).
- ``rowwise_rep_seq``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``; the
  vocab-parallel embedding under SP (output reduce-scattered on seq).
- ``sequence_parallel``: `SequenceParallelNorm`; norm weights replicated, activations seq-sharded, local.
- ``gather_seq_input``: `GatherSequenceInput`; all-gathers a block's seq-sharded input (SP attention, MLP).
- ``replicate_block_input``: `ReplicateBlockInput`; hands a block its replicated input as a DTensor, so
  its column-parallel projections' input gradients are all-reduced once, summed (TP attention, MLP).
- ``replicated_with_grad_allreduce``: `ReplicatedWithGradAllReduce`; replicated weights applied to this
  rank's slice (per-head q/k norms), their gradient summed over the TP ranks.

transformers' names are accepted too: ``colwise_gather_output`` (= ``colwise_rep``), ``rowwise_split_input``
(= ``rowwise_rep``), ``embedding_rowwise`` (= ``rowwise_rep``), ``embedding_colwise`` (= ``colwise_rep``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

from automodel_distributed.tensor_parallel.linear_styles import (
    ColwiseParallel,
    MlaKvAprojParallel,
    RowwiseParallel,
)
from automodel_distributed.tensor_parallel.sequence import SequenceShardedBlock

__all__ = [
    "ACTIVATION_STYLES",
    "HF_STYLE_ALIASES",
    "STYLE_NAMES",
    "GatherSequenceInput",
    "ReplicateBlockInput",
    "ReplicateParallel",
    "ReplicatedWithGradAllReduce",
    "SequenceParallelNorm",
    "hf_style_is_skipped",
    "parallel_style",
    "to_parallel_style",
]


class SequenceParallelNorm(SequenceParallel):
    """`SequenceParallel` for norms, keeping each parameter's ``requires_grad`` (torch's resets it to True).

    The weights become replicated DTensors (broadcast from TP rank 0, like the other styles); the input is
    this rank's sequence slice (a plain tensor is taken as ``Shard(sequence_dim)``); the output is that slice
    again, as a plain tensor by default so that residual additions keep working on plain tensors. The weight
    gradient is a ``Partial`` sum that DTensor reduces over the TP ranks when it is read.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = True) -> None:
        super().__init__(sequence_dim=sequence_dim, use_local_output=use_local_output)

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _replicate_params(module, device_mesh, self.src_data_rank)


def _replicate_params(module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    for p_name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        replicated = distribute_tensor(param.detach(), mesh, [Replicate()], src_data_rank=src_data_rank)
        module.register_parameter(p_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _first_tensor_to_dtensor(
    inputs: tuple[Any, ...], mesh: DeviceMesh, layout: Placement, desired: Placement | None
) -> tuple[Any, ...]:
    if not inputs or not isinstance(inputs[0], torch.Tensor):
        return inputs
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    if desired is not None and x.placements != (desired,):
        x = x.redistribute(placements=(desired,))
    return (x, *inputs[1:])


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters over the TP mesh and run it on DTensor inputs.

    The first positional input, if a plain tensor, is taken to have layout ``input_layouts`` on this rank,
    then redistributed to ``desired_input_layouts`` (``None``: keep it). Because the parameters are
    replicated DTensors, their gradients come out right whatever the input layout: DTensor sums the
    contributions of the TP ranks (lazily, as a ``Partial`` gradient) when the input is sharded.

    Args:
        input_layouts: Layout of a plain-tensor input on this rank (default ``Replicate()``).
        desired_input_layouts: Layout to redistribute the input to before the module runs (``None``: as is).
        use_local_output: Return this rank's local tensor (True) or the DTensor (False).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        desired_input_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts: tuple[Placement, ...] = (input_layouts or Replicate(),)
        self.desired_input_layouts: tuple[Placement | None, ...] = (desired_input_layouts,)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout, desired = self.input_layouts[0], self.desired_input_layouts[0]
        src = self.src_data_rank

        def partition(_name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            _replicate_params(submodule, mesh, src)

        def prepare_input(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return _first_tensor_to_dtensor(inputs, mesh, layout, desired)

        def prepare_output(_mod: nn.Module, outputs: Any, _mesh: DeviceMesh) -> Any:
            if self.use_local_output and isinstance(outputs, DTensor):
                return outputs.to_local()
            return outputs

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"desired_input_layouts={self.desired_input_layouts}, use_local_output={self.use_local_output})"
        )


class ReplicatedWithGradAllReduce(ReplicateParallel):
    """Replicated weights applied to this rank's slice of an activation, e.g. Qwen3's per-head q/k norms.

    After a column-parallel ``q_proj`` each rank normalises only its own heads, so each rank's weight
    gradient covers only those heads and the true gradient is the sum over the TP ranks. The input is
    declared sharded on dim 0 (any non-normalised dim would do: the module must act row by row on its
    last dim), which makes DTensor produce a ``Partial`` weight gradient that it sums over the TP ranks
    when it is used (optimizer step, norm clipping, FSDP2 reduction). Unlike an all-reduce hook on
    ``.grad`` this stays right under gradient accumulation. The output is the local slice, unchanged.
    """

    def __init__(self) -> None:
        super().__init__(input_layouts=Shard(0), desired_input_layouts=None, use_local_output=True)


class GatherSequenceInput(ParallelStyle):
    """All-gather a block's sequence-sharded input before the block runs (attention or MLP under SP).

    The input is the first positional tensor or, when the block is called with keywords only (transformers'
    decoder layers call ``self_attn(hidden_states=...)``), the keyword ``kwarg_name`` or the name of the
    block's first ``forward`` parameter. A plain tensor is taken as this rank's ``Shard(sequence_dim)``
    slice. The block receives a replicated DTensor (or, with
    ``use_local_output``, the gathered plain tensor); its column-parallel projections accept it as is, so
    their input gradients are summed once, by the reduce-scatter that is the all-gather's backward.

    Args:
        sequence_dim: The sequence dim of the activation.
        kwarg_name: Keyword that carries the input when no positional tensor is given.
        use_local_output: Hand the block a plain tensor instead of a DTensor.
    """

    def __init__(
        self, *, sequence_dim: int = 1, kwarg_name: str = "hidden_states", use_local_output: bool = False
    ) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim
        self.kwarg_name = kwarg_name
        self.use_local_output = use_local_output

    def _gather(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(self.sequence_dim),), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        return x.to_local() if self.use_local_output else x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # The keyword, and the name of the forward's first parameter (a caller may pass it by name).
        names = dict.fromkeys((self.kwarg_name, *list(inspect.signature(module.forward).parameters)[:1]))

        def hook(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args and isinstance(args[0], torch.Tensor):
                return (self._gather(args[0], device_mesh), *args[1:]), kwargs
            for name in names:
                value = kwargs.get(name)
                if isinstance(value, torch.Tensor):
                    return args, {**kwargs, name: self._gather(value, device_mesh)}
            raise ValueError(
                f"{type(self).__name__} on {type(mod).__name__}: no input tensor (neither a positional "
                f"tensor nor one of the keywords {list(names)})"
            )

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sequence_dim={self.sequence_dim}, kwarg_name={self.kwarg_name!r}, "
            f"use_local_output={self.use_local_output})"
        )


class ReplicateBlockInput(GatherSequenceInput):
    """Hand a block (attention or MLP) its replicated input as a replicated DTensor (TP without SP).

    Its column-parallel projections accept the DTensor as is, so autograd sums their input gradients
    (``Partial`` DTensors) before the one all-reduce that makes the sum whole, where each projection's
    own plain input would all-reduce its gradient on its own (q, k and v: three instead of one). The
    input is found as `GatherSequenceInput` finds it; a plain tensor is taken as ``Replicate()``.
    """

    def _gather(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return x.to_local() if self.use_local_output else x


ACTIVATION_STYLES: tuple[type[ParallelStyle], ...] = (
    GatherSequenceInput,
    MlaKvAprojParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    SequenceShardedBlock,
)
"""Styles that only transform a module's inputs or outputs and leave its parameters alone (so they also
apply to a LoRA-wrapped module as a whole)."""

STYLE_NAMES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": lambda: ColwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_vocab": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    "colwise_seq_rep": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    "colwise_seq_vocab": lambda: ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    ),
    "rowwise": lambda: RowwiseParallel(),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_seq": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "rowwise_rep_seq": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "sequence_parallel": lambda: SequenceParallelNorm(),
    "gather_seq_input": lambda: GatherSequenceInput(),
    "replicate_block_input": lambda: ReplicateBlockInput(),
    "replicated_with_grad_allreduce": lambda: ReplicatedWithGradAllReduce(),
}
"""Style name -> factory of a fresh style (see the module docstring for what each one does)."""

HF_STYLE_ALIASES: dict[str, str] = {
    "colwise_gather_output": "colwise_rep",
    "rowwise_split_input": "rowwise_rep",
    "embedding_rowwise": "rowwise_rep",
    "embedding_colwise": "colwise_rep",
}
"""transformers' style names that mean one of ours."""

# transformers styles for experts, expert parallelism and runtime-local tricks (``all_reduce`` sums what
# local-parameter entries under it compute). Leaving such a module out of the plan, with every entry under
# it, keeps it replicated, which is exact (if not memory-saving) because its input is replicated.
_HF_SKIPPED_PREFIXES = ("ep_", "local", "moe_", "packed_", "grouped_")
_HF_SKIPPED_NAMES = frozenset({"gather", "replicate", "all_reduce"})


def hf_style_is_skipped(name: str) -> bool:
    """Whether a transformers plan style is one we leave out (experts, EP, local, all-reduce, replicate)."""
    return name in _HF_SKIPPED_NAMES or name.startswith(_HF_SKIPPED_PREFIXES)


def parallel_style(name: str) -> ParallelStyle:
    """A fresh `ParallelStyle` for a style name (ours or a transformers alias).

    Raises:
        ValueError: An unknown name; the message lists the known ones.
    """
    key = HF_STYLE_ALIASES.get(name, name)
    factory = STYLE_NAMES.get(key)
    if factory is None:
        raise ValueError(
            f"unknown tensor-parallel style {name!r}; known styles: {sorted(STYLE_NAMES)} "
            f"(and transformers' {sorted(HF_STYLE_ALIASES)}), or pass a ParallelStyle object"
        )
    return factory()


def to_parallel_style(value: object, *, where: str) -> ParallelStyle:
    """Return ``value`` if it is a `ParallelStyle`, else the style its name stands for.

    Args:
        value: A `ParallelStyle` or a style name.
        where: What the value is, for the error message (e.g. ``"tp_plan['lm_head']"``).

    Raises:
        ValueError: ``value`` is neither a `ParallelStyle` nor a known name.
    """
    if isinstance(value, ParallelStyle):
        return value
    if isinstance(value, str):
        try:
            return parallel_style(value)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    raise ValueError(f"{where} must be a ParallelStyle or a style name, got {type(value).__name__}")
