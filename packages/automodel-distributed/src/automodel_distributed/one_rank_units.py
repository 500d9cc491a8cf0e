"""FSDP units on a one-rank mesh, left out of FSDP: its dtype casts and gradient division done by hooks.

Expert parallelism hands the experts back as units on the ``ep_shard`` mesh. When that mesh has one rank
(``ep_size`` equal to the non-pipeline world), ``fully_shard`` over it shards and reduces nothing, yet
copies the parameters into an unsharded buffer in every forward, keeps that copy until backward when the
block does not reshard, and copies each gradient into a reduce buffer: for Qwen3-30B-A3B's widths with 16
local experts a layer, 144 MiB held per layer from forward to backward plus flat buffers of the same size
(measured by counting live tensors in ``benchmarks/bench_scale.py``'s MoE job).

`runs_without_fsdp` says when such a unit can be left to plain autograd instead: one rank, no CPU
offload, and parameters that already have the policy's compute dtype (otherwise FSDP's unsharded copy is
the compute copy and stays). `install_one_rank_unit` then does the rest of what FSDP would: it casts the
unit's floating inputs to ``param_dtype`` and its outputs to ``output_dtype`` as FSDP does, and divides
each gradient by the unit's divide factor in the policy's ``reduce_dtype`` (a single backward gives FSDP's
gradient bit for bit). `automodel_distributed.fsdp2.apply_fsdp2` passes the parameters to the enclosing
units' ``fully_shard(ignored_params=...)``. NeMo AutoModel likewise keeps experts out of FSDP when
``ep_shard`` is 1.

One difference remains, by design: with gradient accumulation (``set_requires_gradient_sync(False)``
between micro-batches) FSDP accumulates in ``reduce_dtype``, autograd here in the parameters' dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

__all__ = ["install_one_rank_unit", "runs_without_fsdp"]


def runs_without_fsdp(
    module: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy | None
) -> bool:
    """Whether ``fully_shard(module, mesh=mesh, ...)`` would only copy: leave the unit to autograd.

    True when ``mesh`` has one rank, nothing is offloaded, the module has parameters and every one of them
    already has ``mp_policy.param_dtype`` (or the policy sets none). Reads only; no collective.
    """
    if mesh.size() != 1 or isinstance(offload_policy, CPUOffloadPolicy):
        return False
    params = list(module.parameters())
    dtype = mp_policy.param_dtype
    return bool(params) and (dtype is None or all(p.dtype == dtype for p in params))


def _cast(dtype: torch.dtype | None) -> Callable[[Any], Any]:
    def cast(tree: Any) -> Any:
        if dtype is None:
            return tree
        return tree_map_only(
            torch.Tensor,
            lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t,
            tree,
        )

    return cast


def _divide(factor: float, reduce_dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def divide(grad: torch.Tensor) -> torch.Tensor:
        # As FSDP's one-rank reduction: to the reduce dtype, divide, back to the gradient's dtype.
        wide = grad.to(reduce_dtype) if reduce_dtype is not None else grad
        return (wide / factor).to(grad.dtype)

    return divide


def install_one_rank_unit(
    module: nn.Module, mp_policy: MixedPrecisionPolicy, gradient_divide_factor: float | None
) -> list[RemovableHandle]:
    """Give a unit that `runs_without_fsdp` the casts and gradient division FSDP would apply.

    Preconditions: `runs_without_fsdp` is true for ``module``; the caller keeps every enclosing
    ``fully_shard`` off its parameters (``ignored_params``). Mutates ``module``: a forward pre-hook casts
    floating inputs (args and kwargs) to ``param_dtype`` when ``cast_forward_inputs`` is set; each
    parameter that requires a gradient now, or at a later forward (adapters may be unfrozen after
    sharding), gets a tensor hook dividing its gradient by ``gradient_divide_factor`` (``None``: by 1,
    the one rank); a forward hook casts outputs to ``output_dtype``. No collective. Returns the module
    hooks' handles.
    """
    to_param = _cast(mp_policy.param_dtype if mp_policy.cast_forward_inputs else None)
    divide = (
        _divide(gradient_divide_factor, mp_policy.reduce_dtype)
        if gradient_divide_factor is not None and gradient_divide_factor != 1
        else None
    )
    # Weak: materialising a meta model or moving it may replace the parameters (a new one can reuse a
    # freed one's id), and each replacement needs its own hook.
    divided: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def register() -> None:
        assert divide is not None, "only called with a divide factor"
        for param in module.parameters():
            if param.requires_grad and divided.get(id(param)) is not param:
                param.register_hook(divide)
                divided[id(param)] = param

    # Registering hooks is nothing to trace into a compiled block.
    hook_trainable: Callable[[], None] = torch.compiler.disable(register)

    def pre_forward(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if divide is not None:
            hook_trainable()
        return to_param(args), to_param(kwargs)

    if divide is not None:
        hook_trainable()

    handles = [module.register_forward_pre_hook(pre_forward, with_kwargs=True)]
    if mp_policy.output_dtype is not None:
        to_output = _cast(mp_policy.output_dtype)
        handles.append(module.register_forward_hook(lambda _m, _args, output: to_output(output)))
    return handles
