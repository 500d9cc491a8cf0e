"""Expert parallelism for HF MoE models, as one step of the FSDP2 applier of automodel-distributed.

`ExpertParallel` (the ``automodel_distributed.fsdp2.ExpertParallelism`` step an `FSDP2Manager` runs
first) finds the model's experts modules from its own metadata (`automodel_moe.registry.find_experts`),
cuts their stacked weights over ``ep`` and sends each token to its experts' ranks
(`automodel_moe.experts`), and hands the experts back as FSDP units of their own: sharded over the
``ep_shard`` axis along another dim than ``ep``'s (so there can be more shards than local experts), with
their reduced gradient divided by the dense data-parallel size (their gradients hold every ep rank's
tokens). The manager then checkpoints the blocks, saving `ROUTER_SAVE_OPS`, and shards the dense units:
one path for dense and MoE models, honouring every `FSDP2Config` setting. Under pipeline parallelism each
stage runs the same step on the layers it holds. With tensor parallelism the TP plan shards attention and
the dense layers over ``tp`` and leaves the experts and their routers (`find_routers`) to this step;
sequence parallelism is refused with EP. Context parallelism composes: each rank routes the tokens of
its sequence shard, and the experts' gradients hold every ep rank's tokens as without it.

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
from torch.distributed.tensor import DTensor, Shard

from automodel_distributed.config import FSDP2Config
from automodel_distributed.fsdp2 import ExpertSharding, FSDP2Manager
from automodel_distributed.fsdp2_units import FSDPUnitPlan
from automodel_mesh import MeshAxisName, MeshContext
from automodel_moe.config import MoEParallelizerConfig
from automodel_moe.experts import (
    install_dispatch,
    routed_exchange_available,
    shard_experts,
    unsupported_parts,
)
from automodel_moe.registry import ExpertsCall, ExpertsSite, find_experts, find_routers, has_experts

__all__ = [
    "ROUTER_SAVE_OPS",
    "ExpertParallel",
    "apply_expert_parallel",
    "check_expert_parallel",
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


def check_expert_parallel(model: nn.Module, mesh: MeshContext) -> list[ExpertsSite]:
    """The model's experts sites, after checking that expert parallelism over ``mesh`` can shard them.

    Pure (nothing is changed, no collective), so a refusal is the same `ValueError` on every rank.

    Raises:
        ValueError: No experts module (a dense model, or experts of a class the metadata does not
            describe: the message says how to register one), an expert count not divisible by
            ``ep_size``, or parameters that are not per-expert inside an experts module.
    """
    sites = find_experts(model)
    name = type(model).__name__
    if not sites:
        if has_experts(model):
            classes = sorted(
                {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")}
            )
            raise ValueError(
                f"expert parallelism: {name} has experts ({classes}) of a kind transformers' metadata "
                "does not describe (no use_experts_implementation decorator, no ep_dispatch_experts in its "
                "ep plan); "
                "register their layout with automodel_moe.register_moe_family(MoEFamily(experts_class=...)) "
                "or use ep_size=1"
            )
        raise ValueError(
            f"expert parallelism (ep_size={mesh.ep_size}) needs a mixture-of-experts model; {name} has no "
            "experts module"
        )
    ep = mesh.ep_size
    for site in sites:
        if site.num_experts % ep:
            raise ValueError(f"{site.fqn}: num_experts={site.num_experts} is not divisible by ep_size={ep}")
        bad = unsupported_parts(site)
        if bad:
            raise ValueError(
                f"expert parallelism: {site.fqn} ({type(site.core).__name__}) holds parameters that are "
                f"not cut by expert: {bad}; not supported yet (use ep_size=1)"
            )
    if any(site.call is ExpertsCall.ROUTED for site in sites) and not routed_exchange_available():
        import transformers

        raise ValueError(
            f"expert parallelism of {name}'s routed experts runs transformers' own token exchange "
            f"(transformers.distributed.expert_parallel.AllToAllEP), which transformers "
            f"{transformers.__version__} does not have; upgrade transformers (5.24 has it) or use ep_size=1"
        )
    return sites


def apply_expert_parallel(model: nn.Module, mesh: MeshContext) -> list[ExpertsSite]:
    """Cut every experts module of ``model`` over ``ep`` and install its token exchange, in place.

    Preconditions: weights real and identical on every rank (each rank then keeps its slice, no
    communication) or on the meta device; nothing sharded yet; ``mesh.ep_size > 1``. Under pipeline
    parallelism (``mesh.pp_size > 1``) ``model`` is one stage, checked whole before the split
    (`ExpertParallel.check`): a stage that holds only dense layers has nothing to cut (an empty list).
    Mesh axes: ``ep`` (the exchanges), ``tp`` (ranks sharing a batch). Raises what
    `check_expert_parallel` raises, before any change. Returns the sites.
    """
    if mesh.pp_size > 1 and not has_experts(model):
        logger.info("expert parallel: this pipeline stage of %s holds no experts", type(model).__name__)
        return []
    sites = check_expert_parallel(model, mesh)
    ep_mesh = mesh.submesh(MeshAxisName.EP)
    tp_mesh = mesh.submesh(MeshAxisName.TP)
    for site in sites:
        shard_experts(site, ep_mesh)
        install_dispatch(site, ep_mesh, tp_mesh)
        logger.debug("expert parallel: %s (%s) over ep=%d", site.fqn, site.source, ep_mesh.size())
    return sites


def _fsdp_placement(param: nn.Parameter) -> Shard:
    # FSDP cuts another dim than the expert one that ep cuts: dim 1 of the stacked weights [E, ...] and
    # of lora_A [r*E, in]; dim 0 of lora_B [out, r*E].
    ep_dims = [p.dim for p in param.placements if hasattr(p, "dim")] if isinstance(param, DTensor) else []
    return Shard(0) if (ep_dims and ep_dims[0] != 0) or param.dim() < 2 else Shard(1)


@dataclass(frozen=True)
class ExpertParallel:
    """The expert-parallel step of `FSDP2Manager` (implements ``ExpertParallelism``).

    Args:
        config: The MoE settings; its FSDP fields (``mp_policy``, ``reshard_after_forward``,
            ``lm_head_precision``, ``wrap_outer_model``) go to the applier, where `FSDP2Config` leaves
            them unset (see ``automodel_distributed.fsdp2.ExpertSharding``).
    """

    config: MoEParallelizerConfig = field(default_factory=MoEParallelizerConfig)

    def check(self, model: nn.Module, mesh: MeshContext) -> None:
        """Raise what `check_expert_parallel` raises for the whole ``model`` (pure, no collective).

        `apply_model_infrastructure` calls it before any change: under pipeline parallelism `apply` then
        runs per stage, and a stage holding only dense layers is not refused there.
        """
        if mesh.ep_size > 1:
            check_expert_parallel(model, mesh)

    def apply(self, model: nn.Module, mesh: MeshContext) -> ExpertSharding:
        """Shard the experts over ``ep`` in place; return them as FSDP units on ``ep_shard``.

        Mesh axes: ``ep`` (two token exchanges and a count exchange per MoE layer forward), ``ep_shard``
        for the experts' FSDP, ``tp`` (the ranks of a tensor-parallel group split the tokens they share
        before the exchange; the TP plan leaves the experts and routers alone). Raises ``ValueError``
        before any change (`check_expert_parallel`).
        """
        units: tuple[FSDPUnitPlan, ...] = ()
        exclude: tuple[str, ...] = ()
        if mesh.ep_size > 1:
            sites = apply_expert_parallel(model, mesh)
            # Tensor parallelism shards the rest: the experts are cut over ep already, and the routers
            # stay replicated (every rank of a tp group routes the whole batch it shares; the exchange
            # then splits the tokens over tp).
            exclude = (*(site.fqn for site in sites), *find_routers(model))
            # Expert gradients hold the contributions of every ep rank's tokens (each counted once, the
            # ranks of a tensor-parallel group splitting theirs): divide by the dense data-parallel size,
            # so both kinds of parameter get the gradient of the mean loss.
            dp_size = mesh.dp_shard_cp_size * (mesh.dp_replicate_size or 1)
            units = tuple(
                FSDPUnitPlan(
                    site.fqn,
                    site.module,
                    None,  # as the block that holds them
                    mesh=mesh.submesh(MeshAxisName.EP_SHARD),
                    shard_placement_fn=_fsdp_placement,
                    gradient_divide_factor=float(dp_size),
                )
                for site in sites
            )
        else:
            warnings.warn(
                "expert parallelism: ep_size is 1, experts stay in their blocks' FSDP units", stacklevel=3
            )
        cfg = self.config
        return ExpertSharding(
            units=units,
            tensor_parallel_exclude=exclude,
            checkpoint_save_ops=ROUTER_SAVE_OPS if cfg.ignore_router_for_ac else (),
            mp_policy=cfg.mp_policy,
            reshard_after_forward=cfg.reshard_after_forward,
            lm_head_param_dtype=cfg.lm_head_precision,
            wrap_root=cfg.wrap_outer_model,
            checkpointing_settings=tuple(
                f"MoEParallelizerConfig.{name}" for name in cfg.changed_fields(["ignore_router_for_ac"])
            ),
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

    Preconditions: ``model`` is a transformers MoE causal LM whose experts `automodel_moe.find_experts`
    finds, with real weights identical on every rank (each rank keeps its slice) or on the meta device;
    nothing is sharded yet. Mesh axes: ``ep`` of ``moe_mesh`` for experts, ``ep_shard`` for the experts'
    FSDP, ``tp`` for attention and dense layers (the TP plan leaves experts and routers to EP),
    ``dp_shard_cp`` (and ``dp_replicate``) for every other module's FSDP.

    Returns ``model`` (its class becomes ``FSDP<Class>`` when sharded).

    Raises:
        ValueError: What `check_expert_parallel` raises (no experts module, experts not divisible by ep,
            cp > 1, ...), an unknown keyword, no ``ep_shard`` axis with experts to shard (all before any
            change).
    """
    ctx = MeshContext.from_meshes(world_mesh, moe_mesh)
    ignored = {k: v for k, v in unsupported.items() if v not in (None, False, "root", "all")}
    if ignored:
        raise ValueError(f"parallelize_model does not support {sorted(ignored)} yet (got {ignored})")
    del dp_axis_names, ep_axis_name  # the manager takes the standard axes from the mesh
    del tp_axis_name, cp_axis_name  # the manager's tp plan shards attention and dense layers over "tp"
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
    )
    return FSDP2Manager(fsdp, mesh=ctx, experts=ExpertParallel(moe)).parallelize(model)
