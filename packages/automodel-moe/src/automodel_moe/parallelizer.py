"""`parallelize_model`: expert parallelism + FSDP2 (+ activation checkpointing) for HF MoE models.

Order (in place): 1. expert parallelism (replace each sparse block's experts module by an
`ExpertParallelExperts` sharded over ``ep``); 2. activation checkpointing of the transformer blocks;
3. FSDP2: experts first, on the ``ep_shard`` axis (sharded along dim 1, so there can be more shards than
local experts), then the blocks, embeddings, LM head and root over the dense data-parallel axes. Experts
are sharded first, so the block units skip their parameters.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from automodel_distributed.activation_checkpointing import _set_child, disable_kv_cache
from automodel_distributed.fsdp2 import plan_fsdp_units
from automodel_distributed.layers import find_transformer_blocks
from automodel_mesh import MeshAxisName, MeshContext
from automodel_moe.experts import ExpertParallelExperts
from automodel_moe.registry import MoEFamily, find_moe_family, iter_sparse_blocks

__all__ = [
    "ROUTER_SAVE_OPS",
    "apply_expert_parallel",
    "apply_moe_activation_checkpointing",
    "apply_moe_fsdp",
    "parallelize_model",
]

logger = logging.getLogger(__name__)

ROUTER_SAVE_OPS: tuple[str, ...] = (
    # The router's probabilities: top-k on recompute then runs on the saved, bit-identical input and
    # cannot pick other experts. (Top-k's own outputs are not saved: Mixtral normalises them in place,
    # which a saved selective-checkpoint output must not see.)
    "aten._softmax.default",
    "aten.sort.default",
    "aten.sort.stable",
    "_c10d_functional.all_to_all_single.default",
    "_c10d_functional_autograd.all_to_all_single.default",
)
"""Ops whose outputs router-preserving checkpointing saves: the router probabilities, the expert sort and
the token all-to-alls. (The small count exchange writes into its output in place, so it is recomputed:
one extra tiny all-to-all per MoE layer in backward.) Attention probabilities of eager attention are
softmax outputs too and are then saved as well (sdpa attention has none)."""


def _ops(names: Sequence[str]) -> frozenset[Any]:
    found = set()
    for name in names:
        ns, op, overload = name.split(".")
        with contextlib.suppress(AttributeError, RuntimeError):
            found.add(getattr(getattr(getattr(torch.ops, ns), op), overload))
    return frozenset(found)


def _router_context_fn() -> tuple[Any, Any]:
    saved = _ops(ROUTER_SAVE_OPS)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, family: MoEFamily | None = None
) -> list[ExpertParallelExperts]:
    """Replace every sparse block's experts by an `ExpertParallelExperts` over ``ep_mesh``, in place.

    Preconditions: weights real (each rank then keeps its own slice, no communication) or on meta.
    Raises ``ValueError`` (before any collective) when the expert count does not divide by the ep size.
    Returns the new experts modules.
    """
    family = family or find_moe_family(model)
    ep = ep_mesh.size()
    num_experts = getattr(model.config, family.num_experts_field)
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} ({family.num_experts_field}) is not divisible by ep_size={ep}"
        )
    replaced = []
    for fqn, block in list(iter_sparse_blocks(model, family)):
        old = getattr(block, family.experts_attr)
        new = ExpertParallelExperts(
            getattr(old, family.gate_up_param),
            getattr(old, family.down_param),
            getattr(old, family.act_fn_attr),
            ep_mesh,
            gate_up_name=family.gate_up_param,
            down_name=family.down_param,
        )
        setattr(block, family.experts_attr, new)
        replaced.append(new)
        logger.debug("expert parallel: %s.%s -> %s", fqn, family.experts_attr, new.extra_repr())
    if not replaced:
        raise ValueError(f"{type(model).__name__} has no {family.sparse_block_class} block to parallelize")
    return replaced


def apply_moe_activation_checkpointing(model: nn.Module, *, ignore_router: bool = True) -> nn.Module:
    """Checkpoint every transformer block, in place (non-reentrant ``checkpoint_wrapper``).

    ``ignore_router=True``: selective checkpointing that saves the outputs of `ROUTER_SAVE_OPS` (router
    probabilities, the expert sort and the token all-to-alls) and recomputes everything else, so recompute
    sees the same routing decisions and repeats no collective. False: full recompute.
    """
    disable_kv_cache(model)
    for fqn, block in find_transformer_blocks(model):
        kwargs: dict[str, Any] = {"context_fn": _router_context_fn} if ignore_router else {}
        _set_child(
            model, fqn, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
        )
    return model


def apply_moe_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    ep_shard_mesh: DeviceMesh | None,
    experts: Sequence[ExpertParallelExperts],
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = False,
    lm_head_precision: torch.dtype | None = None,
    wrap_outer_model: bool = True,
    offload_policy: OffloadPolicy | None = None,
    dp_size: int,
) -> nn.Module:
    """FSDP2 with experts on ``ep_shard_mesh`` (dim 1) and everything else on ``dp_mesh``, in place.

    Expert gradients hold the contributions of every ep rank's tokens, so each experts unit divides its
    reduced gradient by the dense ``dp_size`` (FSDP's own average over ``ep_shard`` times the module's
    ``grad_scale``, not by its ep_shard size alone): both kinds of parameter get
    the gradient of the mean loss over all data-parallel ranks.
    """
    offload = offload_policy if offload_policy is not None else OffloadPolicy()
    for module in experts:
        if ep_shard_mesh is None:
            continue
        fully_shard(
            module,
            mesh=ep_shard_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
            shard_placement_fn=lambda _param: Shard(1),
        )
        # FSDP averages over ep_shard; the rest of the 1/dp_size (gloo has no PREMUL_SUM, so no
        # set_gradient_divide_factor) is applied to the local weights' gradients inside the module.
        module.grad_scale = ep_shard_mesh.size() / dp_size
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for unit in plan_fsdp_units(model, reshard_after_forward=reshard_after_forward):
        policy = mp_policy
        if lm_head_precision is not None and unit.module is head:
            policy = MixedPrecisionPolicy(
                param_dtype=lm_head_precision,
                reduce_dtype=mp_policy.reduce_dtype or lm_head_precision,
                output_dtype=mp_policy.output_dtype,
                cast_forward_inputs=True,
            )
        fully_shard(
            unit.module,
            mesh=dp_mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
        )
    if wrap_outer_model:
        fully_shard(
            model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload
        )
    return model


def parallelize_model(
    model: nn.Module,
    world_mesh: DeviceMesh,
    moe_mesh: DeviceMesh | None,
    *,
    dp_axis_names: Sequence[str],
    cp_axis_name: str | None = None,
    tp_axis_name: str | None = None,
    ep_axis_name: str = MeshAxisName.EP.value,
    ep_shard_axis_names: Sequence[str] | None = (MeshAxisName.EP_SHARD.value,),
    activation_checkpointing: bool = False,
    ignore_router_for_ac: bool = True,
    reshard_after_forward: bool = False,
    lm_head_precision: torch.dtype | None = None,
    wrap_outer_model: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    **unsupported: Any,
) -> nn.Module:
    """Apply expert parallelism, activation checkpointing and FSDP2 to an HF MoE model, in place.

    Preconditions: ``model`` is a transformers MoE causal LM of a registered family (see
    `automodel_moe.registry`), with real weights identical on every rank (each rank keeps its slice) or on
    the meta device; nothing is sharded yet. Mesh axes: ``ep`` of ``moe_mesh`` for experts (three
    ``all_to_all_single`` per MoE layer forward), ``ep_shard`` for the experts' FSDP, ``dp_axis_names`` of
    ``world_mesh`` for every other module's FSDP.

    Returns ``model`` (its class becomes ``FSDP<Class>`` when sharded).

    Raises:
        ValueError: Unregistered family, experts not divisible by ep, tp/cp > 1, unknown keyword.
    """
    ctx = MeshContext.from_meshes(world_mesh, moe_mesh)
    ignored = {k: v for k, v in unsupported.items() if v not in (None, False, "root", "all")}
    if ignored:
        raise ValueError(f"parallelize_model does not support {sorted(ignored)} yet (got {ignored})")
    for name, axis in (("tp", tp_axis_name), ("cp", cp_axis_name)):
        if axis is not None and ctx.has_axis(axis) and ctx.submesh(axis).size() > 1:
            raise ValueError(f"automodel_moe: {name}_size > 1 with expert parallelism is not supported yet")
    ep_size = ctx.submesh(ep_axis_name).size() if moe_mesh is not None and ctx.has_axis(ep_axis_name) else 1
    experts: list[ExpertParallelExperts] = []
    if ep_size > 1:
        experts = apply_expert_parallel(model, ctx.submesh(ep_axis_name))
    else:
        find_moe_family(model)
        warnings.warn(
            "parallelize_model: ep_size is 1, experts stay in their blocks' FSDP units", stacklevel=2
        )
    if activation_checkpointing:
        apply_moe_activation_checkpointing(model, ignore_router=ignore_router_for_ac)
    elif not ignore_router_for_ac:
        logger.debug("ignore_router_for_ac has no effect without activation_checkpointing")

    names = [n for n in dp_axis_names if ctx.has_axis(n) and ctx.submesh(n).size() > 1] or [dp_axis_names[-1]]
    dp_mesh = ctx.submesh(*names)
    dp_size = dp_mesh.size()
    if dp_size == 1 and ep_size == 1:
        return model
    ep_shard_mesh = None
    if experts:
        if not ep_shard_axis_names:
            raise ValueError(
                "expert parallelism needs ep_shard_axis_names (the experts' FSDP axis, e.g. ('ep_shard',))"
            )
        ep_shard_mesh = ctx.submesh(*ep_shard_axis_names)
    apply_moe_fsdp(
        model,
        dp_mesh,
        ep_shard_mesh,
        experts,
        mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
        reshard_after_forward=reshard_after_forward,
        lm_head_precision=lm_head_precision,
        wrap_outer_model=wrap_outer_model,
        offload_policy=offload_policy,
        dp_size=dp_size,
    )
    return model
