"""Column- and row-parallel styles for every linear transformers uses, and the MLA key/rope fix.

`ColwiseParallel` and `RowwiseParallel` are torch's styles (subclasses, so every ``isinstance`` check of
torch's classes still holds) with two additions torch lacks:

- transformers' ``Conv1D`` (GPT-2, OpenAI GPT), a linear whose weight is stored ``[in, out]``: the
  column-parallel weight is sharded on dim 1 and its bias on dim 0, the row-parallel weight on dim 0 with
  the bias replicated. torch's styles raise on any module that is not an ``nn.Linear`` or
  ``nn.Embedding``, and transformers' own styles shard a 2-D weight on dim 0 whatever it means.
- An output handed on as a plain tensor is a fresh tensor, not the view DTensor's ``to_local`` returns:
  models may add to it in place (Llama 4's MoE does ``shared_out.add_(routed)``), which autograd forbids
  on the view of a custom function. The copy costs one activation of the output's (local) width, next to
  the collective that usually produced it.

Embeddings shard only their own ``weight`` (torch's styles walk every sub-module's parameters and fail
on an embedding with a child, e.g. a norm).

`MlaKvAprojParallel` is transformers' ``mla_kv_a_proj`` as a torch style: see its docstring.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwiseParallel
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from automodel_modules import is_conv1d, maps_like_linear

__all__ = [
    "ColwiseParallel",
    "MlaKvAprojParallel",
    "RowwiseParallel",
    "linear_features",
    "sum_gradient_over",
]


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``; None for anything else.

    A subclass with a ``forward`` of its own counts only when one call on fake tensors (no compute, meta
    weights included) maps ``(..., in)`` to a tensor ``(..., out)`` as ``F.linear`` does (torchao's
    ``Float8Linear``); one that returns a tuple (a router) or another shape is not a linear here, since
    the column/row-parallel output hooks expect the tensor ``F.linear`` returns.
    """
    if isinstance(module, nn.Linear):
        if type(module).forward is nn.Linear.forward or maps_like_linear(
            module, module.in_features, module.out_features
        ):
            return module.in_features, module.out_features
        return None
    if is_conv1d(module):
        from transformers.pytorch_utils import Conv1D

        if type(module).forward is not Conv1D.forward:
            return None
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def sum_gradient_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the backward sums ``x``'s gradient over ``mesh`` (each rank holds a part of it).

    Built from DTensor: the tensor is declared replicated and its gradient partial, so DTensor all-reduces
    the gradient on its way back, exactly once, also under gradient accumulation.
    """
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _distribute_own(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank: int | None
) -> None:
    """Replace ``module``'s own parameters named in ``placements`` by DTensors with those placements."""
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name)
        if placement is None or isinstance(param, DTensor):
            continue
        sharded = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _local_output(output_layouts: tuple[Placement, ...], use_local_output: bool, outputs: Any) -> Any:
    if outputs.placements != tuple(output_layouts):
        outputs = outputs.redistribute(placements=output_layouts, async_op=True)
    return outputs.to_local().clone() if use_local_output else outputs


class ColwiseParallel(TorchColwiseParallel):
    """torch's ``ColwiseParallel``, also for ``Conv1D``, handing on fresh local outputs (module docstring)."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: tuple[Placement, ...],
        use_local_output: bool,
        mod: nn.Module,
        outputs: Any,
        device_mesh: DeviceMesh,
    ) -> Any:
        return _local_output(output_layouts, use_local_output, outputs)

    def _partition_conv1d_fn(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute_own(module, mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank)

    def _partition_embedding_fn(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute_own(module, mesh, {"weight": Shard(1)}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _distribute_conv1d(self, module, device_mesh)


class RowwiseParallel(TorchRowwiseParallel):
    """torch's ``RowwiseParallel``, also for ``Conv1D``, handing on fresh local outputs (module docstring)."""

    def _partition_conv1d_fn(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute_own(module, mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank)

    def _partition_embedding_fn(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute_own(module, mesh, {"weight": Shard(0)}, self.src_data_rank)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: tuple[Placement, ...],
        use_local_output: bool,
        mod: nn.Module,
        outputs: Any,
        device_mesh: DeviceMesh,
    ) -> Any:
        return _local_output(output_layouts, use_local_output, outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, module, device_mesh)


def _distribute_conv1d(
    style: ColwiseParallel | RowwiseParallel, module: nn.Module, mesh: DeviceMesh
) -> nn.Module:
    """``distribute_module`` with the style's Conv1D partition and its input/output hooks."""
    return distribute_module(
        module,
        mesh,
        style._partition_conv1d_fn,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class MlaKvAprojParallel(ParallelStyle):
    """transformers' ``mla_kv_a_proj``: the key down-projection of multi-head latent attention (DeepSeek-V2).

    ``kv_a_proj_with_mqa`` stays replicated; its output is ``[compressed kv | rope key]``. The compressed
    part goes through a column-parallel ``kv_b_proj``, whose input gradient torch's style already sums
    over the ranks. The rope key (the last ``rope_dim`` features) goes straight into attention, shared by
    every head, so each rank's gradient for it covers only its own heads: this style sums that part of
    the gradient over the TP ranks (`sum_gradient_over`). Parameters are left alone, so the style also
    applies to a LoRA-wrapped projection as a whole.

    Args:
        rope_dim: The rope part of the output (``config.qk_rope_head_dim``).
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 1:
            raise ValueError(f"MlaKvAprojParallel: rope_dim must be an int >= 1, got {rope_dim!r}")
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim

        def hook(_mod: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            kept, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([kept, sum_gradient_over(rope, device_mesh)], dim=-1)

        module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rope_dim={self.rope_dim})"
