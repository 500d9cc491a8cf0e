"""Expert parallelism for HF MoE models, as one step of the FSDP2 applier of automodel-distributed.

`ExpertParallel` (the ``automodel_distributed.fsdp2.ExpertParallelism`` step an `FSDP2Manager` runs
first) replaces each sparse block's experts module by an `ExpertParallelExperts` sharded over ``ep``
(`apply_expert_parallel`) and hands the experts back as FSDP units of their own: sharded over the
``ep_shard`` axis along dim 1 (so there can be more shards than local experts), with their reduced
gradient divided by the dense data-parallel size (their gradients hold every ep rank's tokens). The
manager then checkpoints the blocks, saving `ROUTER_SAVE_OPS`, and shards the dense units: one path for
dense and MoE models, honouring every `FSDP2Config` setting.

`parallelize_model` is the reference system's entry point: it builds that manager from its keyword
arguments.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

from automodel_distributed.config import FSDP2Config
from automodel_distributed.fsdp2 import ExpertSharding, FSDP2Manager, FSDPUnitPlan
from automodel_mesh import MeshAxisName, MeshContext
from automodel_moe.config import MoEParallelizerConfig
from automodel_moe.experts import ExpertParallelExperts
from automodel_moe.registry import MoEFamily, find_moe_family, iter_sparse_blocks

__all__ = ["ROUTER_SAVE_OPS", "ExpertParallel", "apply_expert_parallel", "parallelize_model"]

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


def _experts_on_dim1(_param: nn.Parameter) -> Shard:
    return Shard(1)


@dataclass(frozen=True)
class ExpertParallel:
    """The expert-parallel step of `FSDP2Manager` (implements ``ExpertParallelism``).

    Args:
        config: The MoE settings; its FSDP fields (``mp_policy``, ``reshard_after_forward``,
            ``lm_head_precision``, ``wrap_outer_model``) go to the applier, where `FSDP2Config` leaves
            them unset (see ``automodel_distributed.fsdp2.ExpertSharding``).
    """

    config: MoEParallelizerConfig = field(default_factory=MoEParallelizerConfig)

    def apply(self, model: nn.Module, mesh: MeshContext) -> ExpertSharding:
        """Shard the experts over ``ep`` in place; return them as FSDP units on ``ep_shard``.

        Mesh axes: ``ep`` (three ``all_to_all_single`` per MoE layer forward), ``ep_shard`` for the experts'
        FSDP. Raises ``ValueError`` before any change: an unregistered family, experts not divisible by
        ``ep``, ``tp_size`` or ``cp_size`` above 1.
        """
        family = find_moe_family(model)
        for name, size in (("tp", mesh.tp_size), ("cp", mesh.cp_size)):
            if size > 1:
                raise ValueError(
                    f"automodel_moe: {name}_size > 1 with expert parallelism is not supported yet"
                )
        units: tuple[FSDPUnitPlan, ...] = ()
        if mesh.ep_size > 1:
            experts = apply_expert_parallel(model, mesh.submesh(MeshAxisName.EP), family)
            names = {id(m): fqn for fqn, m in model.named_modules()}
            # Expert gradients hold the contributions of every ep rank's tokens: divide by the dense
            # data-parallel size, so both kinds of parameter get the gradient of the mean loss.
            dp_size = mesh.dp_shard_cp_size * (mesh.dp_replicate_size or 1)
            units = tuple(
                FSDPUnitPlan(
                    names[id(m)],
                    m,
                    None,  # as the block that holds them
                    mesh=mesh.submesh(MeshAxisName.EP_SHARD),
                    shard_placement_fn=_experts_on_dim1,
                    gradient_divide_factor=float(dp_size),
                )
                for m in experts
            )
        else:
            warnings.warn(
                "expert parallelism: ep_size is 1, experts stay in their blocks' FSDP units", stacklevel=3
            )
        cfg = self.config
        return ExpertSharding(
            units=units,
            checkpoint_save_ops=ROUTER_SAVE_OPS if cfg.ignore_router_for_ac else (),
            mp_policy=cfg.mp_policy,
            reshard_after_forward=cfg.reshard_after_forward,
            lm_head_param_dtype=cfg.lm_head_precision,
            wrap_root=cfg.wrap_outer_model,
        )


def parallelize_model(
    model: nn.Module,
    world_mesh: DeviceMesh,
    moe_mesh: DeviceMesh | None,
    *,
    dp_axis_names: Sequence[str],
    cp_axis_name: str | None = None,
    tp_axis_name: str | None = None,
    ep_axis_name: str | None = MeshAxisName.EP.value,
    ep_shard_axis_names: Sequence[str] | None = (MeshAxisName.EP_SHARD.value,),
    activation_checkpointing: bool | str = False,
    ignore_router_for_ac: bool = True,
    activation_checkpointing_scope: str | tuple[str, ...] = "all",
    reshard_after_forward: bool = False,
    lm_head_precision: torch.dtype | str | None = None,
    wrap_outer_model: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    **unsupported: Any,
) -> nn.Module:
    """Apply expert parallelism, activation checkpointing and FSDP2 to an HF MoE model, in place.

    The reference system's signature over the one FSDP2 applier: an `FSDP2Manager` with these settings
    (``mp_policy=None`` means no mixed precision here, as in the reference) and an `ExpertParallel` step.
    The axis names must be the standard ones (`MeshContext.parallelize_axis_kwargs` gives them).

    Preconditions: ``model`` is a transformers MoE causal LM of a registered family (see
    `automodel_moe.registry`), with real weights identical on every rank (each rank keeps its slice) or on
    the meta device; nothing is sharded yet. Mesh axes: ``ep`` of ``moe_mesh`` for experts, ``ep_shard``
    for the experts' FSDP, ``dp_shard_cp`` (and ``dp_replicate``) of ``world_mesh`` for every other
    module's FSDP.

    Returns ``model`` (its class becomes ``FSDP<Class>`` when sharded).

    Raises:
        ValueError: Unregistered family, experts not divisible by ep, tp/cp > 1, an unknown keyword, no
            ``ep_shard`` axis with experts to shard (all before any change).
    """
    ctx = MeshContext.from_meshes(world_mesh, moe_mesh)
    ignored = {k: v for k, v in unsupported.items() if v not in (None, False, "root", "all")}
    if ignored:
        raise ValueError(f"parallelize_model does not support {sorted(ignored)} yet (got {ignored})")
    del dp_axis_names, ep_axis_name  # the manager takes the standard axes from the mesh
    for name, axis in (("tp", tp_axis_name), ("cp", cp_axis_name)):
        if axis is not None and ctx.has_axis(axis) and ctx.submesh(axis).size() > 1:
            raise ValueError(f"automodel_moe: {name}_size > 1 with expert parallelism is not supported yet")
    if ctx.ep_size > 1 and not ep_shard_axis_names:
        raise ValueError(
            "expert parallelism needs ep_shard_axis_names (the experts' FSDP axis, e.g. ('ep_shard',))"
        )
    moe = MoEParallelizerConfig(
        ignore_router_for_ac=ignore_router_for_ac,
        reshard_after_forward=reshard_after_forward,
        lm_head_precision=lm_head_precision,  # type: ignore[arg-type]  # names are normalised
        wrap_outer_model=wrap_outer_model,
        mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
    )
    fsdp = FSDP2Config(
        mp_policy=moe.mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,  # type: ignore[arg-type]  # validated there
        activation_checkpointing_scope=activation_checkpointing_scope,
        tune_host_allocator=False,
    )
    return FSDP2Manager(fsdp, mesh=ctx, experts=ExpertParallel(moe)).parallelize(model)
