"""`with_summed_block_inputs`: one backward all-reduce per attention or MLP for transformers' own plans.

transformers declares its column-parallel projections one by one (``q_proj``, ``k_proj``, ``v_proj``:
``colwise``), each taking the module's replicated input as a plain tensor. torch's style turns that
tensor into a ``Replicate`` DTensor per projection, so in backward each projection's ``Partial`` input
gradient is all-reduced on its own: three all-reduces for q, k and v, two for gate and up, where their
sum needs one. The built-in plans (`automodel_distributed.tensor_parallel.plans`) hand the module its
input as one DTensor instead (`ReplicateBlockInput`), so autograd sums the ``Partial`` gradients first.

This adds that entry to a declared plan, read off the plan and the model's structure alone: on a module
(the parent of two or more column-parallel projections with a replicated input) whose every
parameter-holding sub-module is an entry of the plan. Any other parameterised sub-module (a router, a
down-projection of multi-head latent attention, a norm the plan does not style) might read the input,
where a DTensor would meet its plain parameters, so such a module is left as transformers declares it.
Whatever the module then computes from its input stays exact: DTensor tracks the placements, and an op
mixing the DTensor with a plain tensor raises rather than computing something else.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from automodel_distributed.tensor_parallel._fqn import match_modules, param_module_names
from automodel_distributed.tensor_parallel.styles import ReplicateBlockInput
from automodel_modules import join_fqn

__all__ = ["with_summed_block_inputs"]


def _takes_replicated_input(style: ParallelStyle) -> bool:
    return isinstance(style, ColwiseParallel) and tuple(style.input_layouts) == (Replicate(),)


def _styled(fqn: str, keys: list[list[str]]) -> bool:
    """Whether a concrete module name is matched by one of the plan's keys (split on dots)."""
    parts = fqn.split(".")
    return any(
        len(k) == len(parts) and all(fnmatch(p, t) for p, t in zip(parts, k, strict=True)) for k in keys
    )


def _qualifies(model: nn.Module, parent: str, keys: list[list[str]]) -> bool:
    """Whether every module ``parent`` matches holds parameters only in modules the plan styles."""
    matches = match_modules(model, parent)
    return bool(matches) and all(
        _styled(join_fqn(fqn, name), keys) for fqn, m in matches for name in param_module_names(m)
    )


def with_summed_block_inputs(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with a `ReplicateBlockInput` on each module whose projections can sum their input gradients.

    Pure: the model is only read. See the module docstring for which modules qualify; one the plan
    styles itself gets nothing more. A plan that keeps activations sequence-sharded (Megatron-style: its
    attention and MLP take slices) is returned as is.

    Args:
        model: The model the plan's keys are relative to.
        plan: FQN pattern -> style (`resolve_tp_plan`'s form).
    """
    if any(isinstance(style, SequenceParallel) for style in plan.values()):
        return plan
    groups: dict[str, int] = {}
    for key, style in plan.items():
        parent = key.rpartition(".")[0]
        if parent and _takes_replicated_input(style):
            groups[parent] = groups.get(parent, 0) + 1
    keys = [key.split(".") for key in plan]
    added: dict[str, ParallelStyle] = {
        parent: ReplicateBlockInput()
        for parent, count in groups.items()
        if count > 1 and parent not in plan and _qualifies(model, parent, keys)
    }
    return {**added, **plan}
