"""`with_partial_gradient_params`: replicated parameters that see only this rank's slice get summed gradients.

Between a column-parallel projection that hands on its local slice and the row-parallel projection that
sums the slices (an attention module, an MLP, shared experts: the *sharded region*), every rank runs the
same code on its own heads or features. A parameter that stays replicated there (a per-head q/k norm, an
activation's learned scalars, a gate) is applied to the local slice only, so each rank's gradient is a
part of the true one, and the replicas drift apart a little with every optimizer step: a silently
different model, which a few steps of loss parity barely show. Qwen3's q/k norms are in the built-in
plans; transformers' plans leave others out (Sarvam-MoE's q/k norms, Apertus's xIELU scalars).

This pass finds them from the plan and the module tree, for any plan: each module inside a sharded
region that holds trainable parameters of its own and that the plan does not cover gets
``replicated_with_grad_allreduce`` (`styles.ReplicatedWithGradAllReduce`: its weight gradient becomes
``Partial`` and is summed over the TP ranks). A region's root itself (the attention module) is not
wrapped: its input is replicated, and a parameter it holds directly (attention sinks) is one that its
own forward indexes per head, which the plan must shard.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from automodel_distributed.tensor_parallel.styles import ReplicatedWithGradAllReduce
from automodel_distributed.tensor_parallel.validate import is_local_colwise, modules_by_style

__all__ = ["sharded_regions", "with_partial_gradient_params"]


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _inside(fqn: str, root: str) -> bool:
    return root == "" or fqn == root or fqn.startswith(root + ".")


def sharded_regions(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> set[str]:
    """FQNs of the sharded regions (pure).

    For each column-parallel module that hands on its local slice: its nearest ancestor that also holds
    a row-parallel one.
    """
    by_module = modules_by_style(model, plan)
    rowwise = [
        fqn for fqn, styles in by_module.items() if any(isinstance(s, RowwiseParallel) for s in styles)
    ]
    regions: set[str] = set()
    for fqn, styles in by_module.items():
        if not any(is_local_colwise(s) for s in styles):
            continue
        owner = _parent(fqn)
        while not any(_inside(r, owner) for r in rowwise) and owner:
            owner = _parent(owner)
        if any(_inside(r, owner) for r in rowwise):
            regions.add(owner)
    return regions


def with_partial_gradient_params(
    model: nn.Module, plan: Mapping[str, ParallelStyle]
) -> dict[str, ParallelStyle]:
    """``plan`` plus ``replicated_with_grad_allreduce`` for the uncovered parameter holders of its regions.

    Pure: reads the module tree, mutates nothing. Keys of the added entries are full FQNs.
    """
    planned = set(modules_by_style(model, plan))
    added: dict[str, ParallelStyle] = {}
    for region in sorted(sharded_regions(model, plan)):
        root = model.get_submodule(region) if region else model
        for name, module in root.named_modules(prefix=region):
            covered = any(_inside(name, p) or _inside(p, name) for p in planned)
            if covered or name == region:
                continue
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                added[name] = ReplicatedWithGradAllReduce()
    return {**plan, **added}
