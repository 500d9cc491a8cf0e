"""FSDP2: per-block ``fully_shard`` over the data-parallel axes, composed with TP, EP and checkpointing.

One applier for dense and mixture-of-experts models. The order inside `FSDP2Manager.parallelize` is fixed:
an expert-parallel step when one is plugged in (`ExpertParallelism`, e.g. ``automodel_moe.ExpertParallel``:
it swaps the experts modules and returns them as extra FSDP units), then the tensor/sequence-parallel
plan, then activation checkpointing (saving the ops the expert step names, e.g. the router's), then
``fully_shard`` on the extra units (each on its own mesh), every transformer block, the untied
embeddings and LM head, and finally the root. Checkpoint wrappers must exist before ``fully_shard`` so
FSDP's hooks wrap the recomputation, and TP must come first so FSDP shards DTensors that are already
tensor-parallel.

After a forward without gradients (an evaluation), every unit is resharded (`apply_fsdp2` registers
the hook): units that keep their parameters gathered for backward (the root, the last blocks) would
otherwise stay gathered, and an optimizer built then would hold the unsharded tensors. In backward the
root is resharded as soon as its final norm and head are done, when nothing before the blocks needs
its weights again (`automodel_distributed.root_reshard`): a tied embedding is not held gathered
through every block's backward.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from automodel_distributed.activation_checkpointing import (
    apply_activation_checkpointing,
    check_checkpointing_scope,
    resolve_checkpointing_mode,
)
from automodel_distributed.compile import compile_blocks
from automodel_distributed.config import (
    CompileConfig,
    FrozenSharding,
    FSDP2Config,
    MultimodalDistributedConfig,
    default_mp_policy,
)
from automodel_distributed.fsdp2_units import (
    FSDPUnitPlan,
    _is_tied,
    check_frozen_sharding,
    frozen_towers,
    output_head,
    plan_fsdp_units,
)
from automodel_distributed.kept_precision import (
    cast_buffers_to_reference,
    kept_precision_units,
    reference_dtypes,
)
from automodel_distributed.one_rank_units import install_one_rank_unit, runs_without_fsdp
from automodel_distributed.root_reshard import reshard_root_after_head_backward
from automodel_distributed.strategy import StrategyDefaults
from automodel_distributed.tied_embedding import accumulate_tied_embedding_rows
from automodel_mesh import MeshAxisName, MeshContext, MeshKind
from automodel_modules import reshard_fsdp_units

__all__ = [
    "ExpertParallelism",
    "ExpertSharding",
    "FSDP2Manager",
    "apply_fsdp2",
    "reshard_after_no_grad_forward",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ExpertSharding:
    """What an expert-parallel step hands back to the FSDP2 applier.

    The last four fields are the FSDP settings a MoE config carries (``MoEParallelizerConfig``); the
    strategy's own settings (`FSDP2Config`) apply wherever these leave something unset.
    """

    units: tuple[FSDPUnitPlan, ...] = ()
    """Extra FSDP units (the experts), sharded before the dense units, each on its own mesh."""
    tensor_parallel_exclude: tuple[str, ...] = ()
    """Module FQNs the tensor-parallel plan leaves alone (``apply_tensor_parallel(exclude=...)``): the
    experts, already sharded over ``ep``, and their routers, which every rank runs on the whole batch."""
    checkpoint_save_ops: tuple[str, ...] = ()
    """Ops (``namespace.op.overload``) whose outputs activation checkpointing saves instead of recomputing
    (the router's probabilities and the token all-to-alls, so recompute routes exactly as forward did)."""
    mp_policy: MixedPrecisionPolicy | None = None
    """Mixed precision for every unit, overriding the strategy's; ``None``: the strategy's."""
    reshard_after_forward: bool | None = None
    """Used when the strategy config leaves ``reshard_after_forward`` at ``None``."""
    lm_head_param_dtype: torch.dtype | None = None
    """Parameter dtype of the LM head's unit (an fp32 head under a bf16 policy); ``None``: the policy's."""
    wrap_root: bool = True
    """``fully_shard`` the root too; False leaves its leftover parameters replicated."""
    checkpointing_settings: tuple[str, ...] = ()
    """Settings the step was given that act only under activation checkpointing (``Config.field``
    names); the applier warns, naming them, when checkpointing is off."""


class ExpertParallelism(Protocol):
    """An expert-parallel step the FSDP2 applier runs first (``automodel_moe.ExpertParallel``)."""

    def check(self, model: nn.Module, mesh: MeshContext) -> None:
        """Raise ``ValueError`` when ``apply`` would refuse the whole ``model``; pure, no collective.

        Under pipeline parallelism ``apply`` runs on each stage, which may hold no experts: the caller
        checks the whole model first, before it is split, so every rank refuses the same model.
        """
        ...

    def apply(self, model: nn.Module, mesh: MeshContext) -> ExpertSharding:
        """Shard the experts over the ``ep`` axis in place; return the extra units and settings.

        Raises ``ValueError`` before changing anything when the model or the mesh does not fit.
        """
        ...


def _enclosing_reshard(unit: FSDPUnitPlan, dense: Sequence[FSDPUnitPlan]) -> bool | int:
    """An extra unit's ``reshard_after_forward``: its own, else that of the dense unit containing it."""
    if unit.reshard_after_forward is not None:
        return unit.reshard_after_forward
    owner = next((d for d in dense if unit.fqn.startswith(d.fqn + ".")), None)
    return (
        owner.reshard_after_forward
        if owner is not None and owner.reshard_after_forward is not None
        else False
    )


def _divide_gradients(module: FSDPModule, factor: float, mesh: DeviceMesh) -> None:
    module.set_gradient_divide_factor(factor)
    # A divide factor other than the group size needs PREMUL_SUM, which only NCCL has: elsewhere (gloo)
    # FSDP sums and divides the gradient itself. A one-rank mesh runs no collective (FSDP divides once
    # itself; forcing the sum there would divide twice).
    if mesh.size() > 1 and dist.get_backend(mesh.get_group()) != "nccl":
        module.set_force_sum_reduction_for_comms(True)


def reshard_after_no_grad_forward(root: nn.Module) -> None:
    """After a forward without gradients, reshard every FSDP unit under ``root`` (a forward hook).

    FSDP2 keeps the parameters of units with ``reshard_after_forward=False`` (the root, the last blocks)
    gathered after forward, for the backward that follows; with gradients disabled no backward comes, and
    ``FSDPModule.reshard`` is not recursive. Registered by `apply_fsdp2` on the root. Mutates nothing but
    the units' sharding state; no collective.
    """

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            reshard_fsdp_units(module)

    root.register_forward_hook(hook)


def _shard_extra_units(
    extra_units: Sequence[FSDPUnitPlan],
    dense: Sequence[FSDPUnitPlan],
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    ignored: set[nn.Parameter] | None,
) -> set[nn.Parameter]:
    """``fully_shard`` each extra unit on its mesh; return the parameters of those left out of FSDP.

    An extra unit on a one-rank mesh that FSDP would only copy stays out of it (see one_rank_units);
    every unit that contains it then leaves its parameters alone.
    """
    unsharded: set[nn.Parameter] = set()
    for unit in extra_units:
        mesh = unit.mesh if unit.mesh is not None else dp_mesh
        policy = unit.mp_policy or mp_policy
        if runs_without_fsdp(unit.module, mesh, policy, offload):
            install_one_rank_unit(unit.module, policy, unit.gradient_divide_factor)
            unsharded.update(unit.module.parameters())
            continue
        fully_shard(
            unit.module,
            mesh=mesh,
            reshard_after_forward=_enclosing_reshard(unit, dense),
            mp_policy=policy,
            offload_policy=offload,
            shard_placement_fn=unit.shard_placement_fn,
            ignored_params=ignored,
        )
        if unit.gradient_divide_factor is not None:
            _divide_gradients(unit.module, unit.gradient_divide_factor, mesh)  # type: ignore[arg-type]
    return unsharded


def _shard_dense_units(
    model: nn.Module,
    units: Sequence[FSDPUnitPlan],
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    ignored: set[nn.Parameter] | None,
    lm_head_param_dtype: torch.dtype | None,
) -> None:
    """``fully_shard`` each dense unit over ``dp_mesh`` (the LM head in its own dtype when given)."""
    head = output_head(model)
    if lm_head_param_dtype is not None and head is None and _is_tied(model):
        # A pipeline stage without the head is fine: the last stage applies it.
        warnings.warn(
            f"MoEParallelizerConfig.lm_head_precision={lm_head_param_dtype} ignored: the output head is tied "
            "to the input embedding, which stays in the root unit under mp_policy",
            stacklevel=4,
        )
    for unit in units:
        policy = unit.mp_policy or mp_policy
        if lm_head_param_dtype is not None and unit.module is head:
            policy = MixedPrecisionPolicy(
                param_dtype=lm_head_param_dtype,
                reduce_dtype=policy.reduce_dtype or lm_head_param_dtype,
                output_dtype=policy.output_dtype,
                cast_forward_inputs=True,
            )
        fully_shard(
            unit.module,
            mesh=dp_mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
            ignored_params=ignored,
        )
        if not unit.unshard_in_backward:
            assert isinstance(unit.module, FSDPModule), "fully_shard makes the module an FSDPModule"
            unit.module.set_unshard_in_backward(False)


def apply_fsdp2(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    pipelined: bool = False,
    prefetch: bool = False,
    forward_prefetch_depth: int = 1,
    backward_prefetch_depth: int = 2,
    extra_units: Sequence[FSDPUnitPlan] = (),
    lm_head_param_dtype: torch.dtype | None = None,
    wrap_root: bool = True,
    frozen_sharding: FrozenSharding = "per_layer",
) -> nn.Module:
    """Apply ``fully_shard`` to the extra units, every unit of `plan_fsdp_units`, then the root.

    ``frozen_sharding`` (``FSDP2Config.multimodal.frozen_sharding``) places the frozen towers of a
    multimodal model (`frozen_towers`): ``per_layer``, each tower block its own unit; ``root``, the tower
    is sharded with the root unit; ``replicate``, the tower's parameters are ``fully_shard``'s
    ``ignored_params``: every rank keeps them whole (no all-gather in forward; they get no gradients).

    Extra units (experts, on their own mesh) are sharded first, so the dense units that contain them skip
    their parameters. An extra unit on a one-rank mesh whose parameters already have the policy's compute
    dtype is not sharded at all (`automodel_distributed.one_rank_units`: hooks cast and divide as FSDP
    would, and the enclosing units ignore its parameters). Under a policy that casts, the tensors that
    transformers keeps out of the compute dtype stay out (`automodel_distributed.kept_precision`): the
    modules owning fp32-kept parameters (routers) become extra units that compute in fp32, and buffers
    transformers holds in the compute dtype are cast to it. Preconditions: tensor and expert parallelism
    and activation checkpointing are already applied (the model may be on the meta device). Mesh axes:
    ``dp_mesh`` is the 1-D ``dp_shard_cp`` mesh, or the 2-D ``(dp_replicate, dp_shard_cp)`` mesh for HSDP;
    an extra unit uses its own (``ep_shard`` for experts). Collectives: none at wrap time; all-gathers
    and reduce-scatters during forward/backward.

    Mutates ``model`` in place (its class becomes ``FSDP<Class>``; a forward hook reshards every unit
    after a forward without gradients, `reshard_after_no_grad_forward`; outside a pipeline, hooks
    reshard the root in backward once the modules after its last unit are done with their weights,
    `automodel_distributed.root_reshard`) and returns it.
    """
    units = plan_fsdp_units(
        model,
        reshard_after_forward=reshard_after_forward,
        pipelined=pipelined,
        frozen_sharding=frozen_sharding,
    )
    ignored: set[nn.Parameter] | None = None
    if frozen_sharding == "replicate":
        ignored = {p for _, tower in frozen_towers(model) for p in tower.parameters()} or None
    offload = offload_policy if offload_policy is not None else OffloadPolicy()
    extra_units = [*extra_units, *_keep_reference_precision(model, mp_policy, units)]
    unsharded = _shard_extra_units(extra_units, units, dp_mesh, mp_policy, offload, ignored)
    if unsharded:
        ignored = (ignored or set()) | unsharded
    _shard_dense_units(model, units, dp_mesh, mp_policy, offload, ignored, lm_head_param_dtype)
    if wrap_root:
        # The root's own parameters (final norm, tied embeddings) are needed again at once by backward.
        fully_shard(
            model,
            mesh=dp_mesh,
            reshard_after_forward=False,
            mp_policy=mp_policy,
            offload_policy=offload,
            ignored_params=ignored,
        )
        if not pipelined:
            # A tied embedding in the root is otherwise held gathered through every block's backward.
            reshard_root_after_head_backward(model)
    reshard_after_no_grad_forward(model)
    if prefetch:
        _set_prefetch([u.module for u in units], forward_prefetch_depth, backward_prefetch_depth)
    return model


def _keep_reference_precision(
    model: nn.Module, mp_policy: MixedPrecisionPolicy, dense: Sequence[FSDPUnitPlan]
) -> list[FSDPUnitPlan]:
    """Hold each tensor in the dtype transformers holds it in for the policy's compute dtype.

    `automodel_distributed.kept_precision`: casts the buffers transformers computes in that dtype, and
    returns the modules whose parameters it keeps wider as extra units that do not cast. Mutates buffers
    only; nothing when the policy casts no parameter.
    """
    compute = mp_policy.param_dtype
    if compute is None or all(p.dtype == compute for p in model.parameters() if p.is_floating_point()):
        return []
    reference = reference_dtypes(model, compute)
    cast_buffers_to_reference(model, reference, compute)
    return kept_precision_units(model, mp_policy, reference, dense)


def _set_prefetch(modules: Sequence[nn.Module], forward_depth: int, backward_depth: int) -> None:
    fsdp: list[FSDPModule] = [m for m in modules if isinstance(m, FSDPModule)]
    for i, module in enumerate(fsdp):
        ahead = fsdp[i + 1 : i + 1 + forward_depth]
        behind = list(reversed(fsdp[max(0, i - backward_depth) : i]))
        if ahead:
            module.set_modules_to_forward_prefetch(ahead)
        if behind:
            module.set_modules_to_backward_prefetch(behind)


def _offload_for_host(policy: OffloadPolicy | None) -> OffloadPolicy | None:
    # Pinned host memory needs an accelerator; on a CPU-only host use pageable memory instead.
    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and not torch.cuda.is_available():
        warnings.warn(
            "FSDP2Config.offload_policy asks for pinned memory, which needs an accelerator; using "
            "CPUOffloadPolicy(pin_memory=False) on this CPU-only host",
            stacklevel=3,
        )
        return CPUOffloadPolicy(pin_memory=False)
    return policy


def _one_rank_work(
    model: nn.Module, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy | None
) -> list[str]:
    """The settings FSDP2 carries out even on one data-parallel rank: a dtype cast, CPU offload.

    With one rank FSDP2 shards and reduces nothing, but its mixed precision (compute in ``param_dtype``
    over master weights in the parameters' dtype, gradients in ``reduce_dtype``) and its offload still
    change the numbers and the memory; one rank must train as N ranks do. Reads only.
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    casts = any(
        dtype is not None and dtypes - {dtype} for dtype in (mp_policy.param_dtype, mp_policy.output_dtype)
    )
    return [name for name, on in (("mp_policy", casts), ("offload_policy", offload_policy is not None)) if on]


class FSDP2Manager(StrategyDefaults):
    """Applies an `FSDP2Config` to a model: expert and tensor parallelism, checkpointing, FSDP2, compile.

    Implements `automodel_distributed.strategy.StrategyManager`. Config fields are copied to attributes
    (``manager.mp_policy``, ``manager.tp_plan``, ...), with ``mp_policy`` resolved to the default policy
    when the config left it ``None``. The config object is never modified.

    Args:
        config: The settings.
        device_mesh: The FSDP2 mesh from ``MeshContext.build(FSDP2Config(...))`` (a `MeshContext` is
            accepted here too); ``None`` only in a single process without a process group (nothing is
            sharded then).
        moe_mesh: The MoE mesh (with a ``DeviceMesh`` as ``device_mesh``).
        mesh: The `MeshContext` itself (kept as the object it is, process group included); replaces
            ``device_mesh`` / ``moe_mesh``.
        experts: The expert-parallel step to run first (``automodel_moe.ExpertParallel``), or ``None``.

    Raises:
        ValueError: Not an `FSDP2Config`, a mesh of another layout, no mesh with several ranks, or both
            ``mesh`` and ``device_mesh``.
    """

    def __init__(
        self,
        config: FSDP2Config,
        device_mesh: DeviceMesh | MeshContext | None = None,
        moe_mesh: DeviceMesh | None = None,
        *,
        mesh: MeshContext | None = None,
        experts: ExpertParallelism | None = None,
    ) -> None:
        if not isinstance(config, FSDP2Config):
            raise ValueError(f"FSDP2Manager needs an FSDP2Config, got {type(config).__name__}")
        if isinstance(device_mesh, MeshContext):
            device_mesh, mesh = None, device_mesh if mesh is None else mesh
        if mesh is not None and (device_mesh is not None or moe_mesh is not None):
            raise ValueError("FSDP2Manager takes mesh= or device_mesh= / moe_mesh=, not both")
        self.config = config
        self.mesh = mesh if mesh is not None else MeshContext.from_meshes(device_mesh, moe_mesh)
        self.experts = experts
        if self.mesh.device_mesh is None:
            # A single process without a process group (what MeshContext.build returns there): nothing
            # to shard, but activation checkpointing and compile still apply.
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    "FSDP2Manager got no device mesh in a run of "
                    f"{dist.get_world_size()} ranks; build it with MeshContext.build(FSDP2Config(...))"
                )
        elif self.mesh.kind is not MeshKind.FSDP2:
            raise ValueError(
                "FSDP2Manager needs the FSDP2 mesh (pp, dp_replicate, dp_shard, cp, tp); build it with "
                f"MeshContext.build(FSDP2Config(...)), got axes {self.mesh.axis_names()}"
            )
        self.device_mesh = self.mesh.device_mesh
        self.moe_mesh = self.mesh.moe_mesh
        for name, value in config.to_dict().items():
            setattr(self, name, value)
        self.mp_policy: MixedPrecisionPolicy = (
            config.mp_policy if config.mp_policy is not None else default_mp_policy()
        )
        self.offload_policy: OffloadPolicy | None = _offload_for_host(config.offload_policy)
        self._prepare_host_runtime()

    def _prepare_host_runtime(self) -> None:
        """Let ``config.host_runtime`` make its process-wide settings, before anything is materialised.

        Raises:
            ValueError: A host runtime on an accelerator mesh without CPU offload (it would act on nothing).
        """
        host = self.config.host_runtime
        if host is None or self.device_mesh is None:
            return
        if self.mesh.device_type != "cpu" and self.offload_policy is None:
            raise ValueError(
                f"FSDP2Config.host_runtime ({type(host).__name__}) serves collectives and tensors in host "
                f"memory, but this is a {self.mesh.device_type} mesh without offload_policy: drop it, or "
                "set offload_policy=CPUOffloadPolicy()"
            )
        host.prepare_process()

    # ------------------------------------------------------------------ parallelize

    def _warn_ignored(self) -> None:
        cfg = self.config
        if cfg.sequence_parallel and self.mesh.tp_size == 1:
            warnings.warn("FSDP2Config.sequence_parallel is ignored: tp_size is 1", stacklevel=3)
        if cfg.tp_plan is not None and self.mesh.tp_size == 1:
            warnings.warn("FSDP2Config.tp_plan is ignored: tp_size is 1", stacklevel=3)
        if cfg.enable_async_tensor_parallel and self.mesh.tp_size == 1:
            warnings.warn("FSDP2Config.enable_async_tensor_parallel is ignored: tp_size is 1", stacklevel=3)

    def _warn_no_frozen_tower(self, model: nn.Module) -> None:
        if self.config.multimodal != MultimodalDistributedConfig() and not frozen_towers(model):
            warnings.warn(
                f"FSDP2Config.multimodal.frozen_sharding={self.config.multimodal.frozen_sharding!r} is "
                f"ignored: {type(model).__name__} has no frozen multimodal tower (freeze one with "
                "freeze_config)",
                stacklevel=3,
            )

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place and return it.

        Order: the expert-parallel step (when ``experts`` is set), the TP plan (leaving the modules the
        expert step names alone), activation checkpointing (saving the ops the expert step names), then
        `apply_fsdp2` (expert units first). When sharded, an input embedding tied to the output head adds
        its gradient rows into the shared weight's gradient in place instead of as a third full-size
        tensor (`automodel_distributed.tied_embedding`; the same values bit for bit).

        Preconditions: ``model`` is a transformers-style decoder (blocks found from ``_no_split_modules``),
        on the meta device or on CPU/the target device; nothing is sharded yet. Mesh axes: ``ep`` and
        ``ep_shard`` for experts, ``tp`` for the TP plan, ``dp_shard_cp`` (and ``dp_replicate`` for HSDP)
        for FSDP. With one data-parallel rank FSDP2 still wraps the model when its policy casts a dtype or
        offloads (so one GPU trains in the mixed precision N GPUs do); otherwise nothing is wrapped, and
        activation checkpointing still applies.

        Raises:
            ValueError: ``frozen_sharding="per_layer"`` for a frozen tower without blocks
                (`check_frozen_sharding`), a checkpointing scope naming such a tower
                (`check_checkpointing_scope`), async TP on a host without CUDA, sequence parallelism with
                expert parallelism, a TP plan / head-count problem, or a model the expert step cannot
                shard (all before any collective; only a TP plan problem comes after the expert step's
                local, collective-free change).
        """
        cfg = self.config
        mode = self._check_before_sharding(model)
        extra = self.experts.apply(model, self.mesh) if self.experts is not None else ExpertSharding()
        if cfg.patch_is_packed_sequence:
            _patch_is_packed_sequence(model)
        if self.mesh.tp_size > 1:
            from automodel_distributed.tensor_parallel import (
                apply_tensor_parallel,
                enable_async_tensor_parallel,
            )

            tp_mesh = self.mesh.submesh(MeshAxisName.TP)
            apply_tensor_parallel(
                model,
                tp_mesh,
                tp_plan=cfg.tp_plan,
                sequence_parallel=cfg.sequence_parallel,
                exclude=extra.tensor_parallel_exclude,
            )
            if cfg.enable_async_tensor_parallel:  # CUDA: `_check_before_sharding` refused it elsewhere
                enable_async_tensor_parallel(tp_mesh)
        if mode is None and extra.checkpointing_settings:
            warnings.warn(
                f"{', '.join(extra.checkpointing_settings)} ignored: activation checkpointing is off "
                "(FSDP2Config.activation_checkpointing)",
                stacklevel=3,
            )
        if mode is not None:
            scope = cfg.activation_checkpointing_scope
            assert isinstance(scope, tuple), "FSDP2Config normalises the scope to a tuple"
            apply_activation_checkpointing(model, mode=mode, scope=scope, save_ops=extra.checkpoint_save_ops)
        self._warn_overridden(extra)
        mp_policy = extra.mp_policy if extra.mp_policy is not None else self.mp_policy
        reshard = cfg.reshard_after_forward
        if reshard is None:
            reshard = extra.reshard_after_forward
        one_rank = self.mesh.dp_shard_cp_size * (self.mesh.dp_replicate_size or 1) == 1
        work = _one_rank_work(model, mp_policy, self.offload_policy) if one_rank else []
        if one_rank and not extra.units and (not work or self.device_mesh is None):
            self._warn_nothing_sharded(work)
            return model
        apply_fsdp2(
            model,
            self.dp_mesh(),
            mp_policy=mp_policy,
            offload_policy=self.offload_policy,
            reshard_after_forward=reshard,
            pipelined=self.mesh.pp_enabled,
            prefetch=cfg.enable_fsdp2_prefetch,
            forward_prefetch_depth=cfg.fsdp2_forward_prefetch_depth,
            backward_prefetch_depth=cfg.fsdp2_backward_prefetch_depth,
            extra_units=extra.units,
            lm_head_param_dtype=extra.lm_head_param_dtype,
            wrap_root=extra.wrap_root,
            frozen_sharding=cfg.multimodal.frozen_sharding,
        )
        # FSDP2 reduces after the whole backward, so the rows may join the gradient after accumulation.
        accumulate_tied_embedding_rows(model)
        if cfg.host_runtime is not None and self.mesh.device_type == "cpu":
            cfg.host_runtime.attach_fsdp(model)  # the collectives' buffers live in host memory
        return model

    def _check_before_sharding(self, model: nn.Module) -> Literal["full", "selective"] | None:
        """Every refusal of `parallelize`, before anything changes; returns the checkpointing mode."""
        cfg = self.config
        if self.mesh.ep_size > 1 and self.experts is None:
            warnings.warn(
                f"FSDP2Manager: the mesh has ep_size={self.mesh.ep_size} but no expert step, so the experts "
                "are sharded like dense weights over dp_shard_cp; for expert parallelism build it with "
                "experts=automodel_moe.ExpertParallel(...) (what instantiate_infrastructure does)",
                stacklevel=3,
            )
        self._warn_ignored()
        self._warn_no_frozen_tower(model)
        check_frozen_sharding(model, cfg.multimodal.frozen_sharding)
        mode = resolve_checkpointing_mode(cfg.activation_checkpointing)
        scope = cfg.activation_checkpointing_scope
        assert isinstance(scope, tuple), "FSDP2Config normalises the scope to a tuple"
        if mode is not None:
            check_checkpointing_scope(model, scope)  # before TP changes anything
        tp_size = self.mesh.tp_size
        if cfg.enable_async_tensor_parallel and tp_size > 1 and self.mesh.device_type != "cuda":
            raise ValueError(
                "FSDP2Config.enable_async_tensor_parallel=True needs CUDA devices (symmetric memory); "
                "set it to False on CPU"
            )
        if cfg.sequence_parallel and tp_size > 1 and self.experts is not None and self.mesh.ep_size > 1:
            raise ValueError(
                "FSDP2Config.sequence_parallel=True with expert parallelism (ep_size="
                f"{self.mesh.ep_size}) is not supported yet: the routers and the token exchange take the "
                "whole sequence of the tensor-parallel group; set sequence_parallel=False (TP with EP works)"
            )
        return mode

    def _warn_overridden(self, extra: ExpertSharding) -> None:
        """Name a setting given in both configs whose value loses.

        The expert step's policy wins, and FSDP2Config's resharding (as in NeMo AutoModel).
        """
        cfg = self.config
        if extra.mp_policy is not None and cfg.mp_policy is not None and extra.mp_policy != cfg.mp_policy:
            warnings.warn(
                "FSDP2Config.mp_policy ignored: the expert step's MoEParallelizerConfig.mp_policy applies to "
                "every unit; give the policy in one config",
                stacklevel=4,
            )
        moe_reshard = extra.reshard_after_forward
        if cfg.reshard_after_forward is not None and moe_reshard and cfg.reshard_after_forward != moe_reshard:
            warnings.warn(
                "MoEParallelizerConfig.reshard_after_forward ignored: FSDP2Config.reshard_after_forward="
                f"{cfg.reshard_after_forward!r} applies to every unit; give it in one config",
                stacklevel=4,
            )

    def _warn_nothing_sharded(self, work: list[str]) -> None:
        """With one data-parallel rank left unwrapped, name the settings that then act on nothing.

        ``work``: the settings only FSDP2 carries out (`_one_rank_work`); ignored only without a mesh.
        """
        cfg = self.config
        ignored = [
            name
            for name, active in (
                ("enable_fsdp2_prefetch", cfg.enable_fsdp2_prefetch),
                ("reshard_after_forward", cfg.reshard_after_forward is not None),
                ("host_runtime", cfg.host_runtime is not None),
                ("multimodal", cfg.multimodal != MultimodalDistributedConfig()),
            )
            if active
        ]
        if work:
            warnings.warn(
                f"FSDP2Config.{', FSDP2Config.'.join(work + ignored)} ignored: a single process without a "
                "process group has no mesh for FSDP2; start it with torchrun (or call "
                "torch.distributed.init_process_group) to get FSDP2's mixed precision on one rank",
                stacklevel=3,
            )
        elif ignored:
            warnings.warn(
                f"FSDP2Config.{', FSDP2Config.'.join(ignored)} ignored: one data-parallel rank, and no dtype "
                "for FSDP2 to cast nor offload to do, so nothing is wrapped",
                stacklevel=3,
            )

    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP."""
        if (self.mesh.dp_replicate_size or 1) > 1:
            return self.mesh.submesh(MeshAxisName.DP_REPLICATE, MeshAxisName.DP_SHARD_CP)
        return self.mesh.submesh(MeshAxisName.DP_SHARD_CP)

    def maybe_compile(self, model: nn.Module) -> nn.Module:
        """Compile each transformer block in place when ``enable_compile`` is set; a no-op otherwise."""
        if self.config.enable_compile:
            compile_blocks(model)
        return model

    # ------------------------------------------------------------------ StrategyManager

    def check(self, model: nn.Module) -> None:
        """The expert step's refusal of the whole model (`ExpertParallelism.check`), before any split."""
        if self.experts is not None:
            self.experts.check(model, self.mesh)

    def shard(self, model: nn.Module) -> nn.Module:
        """`parallelize`."""
        return self.parallelize(model)

    def loads_before_sharding(self, *, adapters: bool) -> bool:
        """`FSDP2Config.loads_before_sharding` on this mesh: only when nothing is sharded, no adapters."""
        return self.config.loads_before_sharding(self.mesh.layout, adapters=adapters)

    def init_device(self, device: torch.device | str) -> torch.device | str:
        """CPU under CPU offload (the shards live there), else ``device``."""
        return "cpu" if self.offload_policy is not None else device

    def compile(self, model: nn.Module, config: CompileConfig | None, *, in_place: bool) -> nn.Module:
        """Compile every block in place (parameter names unchanged), from ``config`` or ``enable_compile``."""
        del in_place  # FSDP2 units are compiled in place in every case
        if config is not None and config.enabled:
            return compile_blocks(model, config)
        return self.maybe_compile(model)

    def place(self, model: nn.Module, device: torch.device | str) -> None:
        """Nothing under CPU offload (FSDP moves the shards); else move what is not a DTensor."""
        if self.offload_policy is None:
            super().place(model, device)

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, *, enabled: bool) -> Iterator[None]:
        """Reduce-scatter in this micro-batch's backward when ``enabled`` or not ``defer_fsdp_grad_sync``."""
        self.set_gradient_sync(model, is_last_microbatch=enabled)
        yield

    # ------------------------------------------------------------------ training-loop helpers

    def set_gradient_sync(self, model: nn.Module, *, is_last_microbatch: bool) -> None:
        """Before each micro-batch's backward: reduce gradients only on the last one when deferring.

        With ``defer_fsdp_grad_sync`` gradients accumulate unsharded-and-unreduced locally and are
        reduce-scattered once; otherwise every micro-batch reduces. Numerically the same either way.
        """
        sync = is_last_microbatch or not self.config.defer_fsdp_grad_sync
        # Every unit, not only a root: the expert route may leave the outer model unwrapped.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(sync, recurse=False)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Context for the forward pass: ``torch.autocast`` with ``autocast_dtype``, or nothing."""
        dtype = self.config.autocast_dtype
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=self.mesh.device_type, dtype=dtype):
            yield


def _patch_is_packed_sequence(model: nn.Module) -> None:
    # transformers inspects position_ids to detect packed sequences, which costs a device-to-host sync
    # per forward; the user asserted batches are never packed. Only its flash-attention path asks.
    import transformers.modeling_flash_attention_utils as fa_utils

    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
    if "flash" not in implementation:
        warnings.warn(
            "FSDP2Config.patch_is_packed_sequence ignored: only transformers' flash-attention path looks "
            f"for packed sequences, and this model's attention is {implementation!r}",
            stacklevel=4,
        )
        return

    def _never_packed(*_args: Any, **_kwargs: Any) -> bool:
        return False

    fa_utils._is_packed_sequence = _never_packed
    logger.info("FSDP2: transformers' _is_packed_sequence patched to return False")
