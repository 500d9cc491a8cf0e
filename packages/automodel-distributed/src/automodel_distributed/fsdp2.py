"""FSDP2: per-block ``fully_shard`` over the data-parallel axes, composed with TP and checkpointing.

The order inside `FSDP2Manager.parallelize` is fixed: tensor/sequence parallel plan, then activation
checkpointing, then ``fully_shard`` on every transformer block, the untied embeddings and LM head, and
finally the root. Checkpoint wrappers must exist before ``fully_shard`` so FSDP's hooks wrap the
recomputation, and TP must come first so FSDP shards DTensors that are already tensor-parallel.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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
    resolve_checkpointing_mode,
)
from automodel_distributed.compile import compile_blocks
from automodel_distributed.config import FSDP2Config, MultimodalDistributedConfig, default_mp_policy
from automodel_distributed.layers import find_transformer_blocks
from automodel_mesh import MeshAxisName, MeshContext, MeshKind

__all__ = ["FSDP2Manager", "FSDPUnitPlan", "apply_fsdp2", "plan_fsdp_units"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FSDPUnitPlan:
    """One module that becomes its own FSDP unit, and whether it reshards after forward."""

    fqn: str
    module: nn.Module
    reshard_after_forward: bool | int


def _is_tied(model: nn.Module) -> bool:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return False
    inp, out = get_in(), get_out()
    return inp is not None and out is not None and inp.weight is out.weight


def _fqn_of(model: nn.Module, target: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if module is target:
            return name
    return None


def plan_fsdp_units(
    model: nn.Module, *, reshard_after_forward: bool | int | None, pipelined: bool = False
) -> list[FSDPUnitPlan]:
    """Decide the FSDP units of a model, in forward order, without touching it.

    Units: the input embedding (when untied), every transformer block, the LM head (when untied). The
    root unit (final norm and whatever is left) is added by `apply_fsdp2`. Tied embeddings stay in the
    root so the shared weight lives in exactly one unit.

    ``reshard_after_forward=None`` applies the usual heuristic: reshard every unit after forward except
    the last ones to run (the last block and the LM head), whose parameters backward needs at once; under
    pipelining nothing reshards, since each micro-batch's backward follows soon after its forward.
    """
    units: list[tuple[str, nn.Module]] = []
    tied = _is_tied(model)
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) and not tied else None
    head = get_out() if callable(get_out) and not tied else None
    if isinstance(embed, nn.Module) and (fqn := _fqn_of(model, embed)):
        units.append((fqn, embed))
    units.extend(find_transformer_blocks(model))
    if isinstance(head, nn.Module) and (fqn := _fqn_of(model, head)):
        units.append((fqn, head))

    def policy(index: int) -> bool | int:
        if reshard_after_forward is not None:
            return reshard_after_forward
        if pipelined:
            return False
        is_last_block = index == len(units) - 1 or (head is not None and index == len(units) - 2)
        return not is_last_block

    return [FSDPUnitPlan(fqn, module, policy(i)) for i, (fqn, module) in enumerate(units)]


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
) -> nn.Module:
    """Apply ``fully_shard`` to every unit of `plan_fsdp_units`, then to the root.

    Preconditions: tensor parallelism and activation checkpointing are already applied (the model may
    be on the meta device). Mesh axes: ``dp_mesh`` is the 1-D ``dp_shard_cp`` mesh, or the 2-D
    ``(dp_replicate, dp_shard_cp)`` mesh for HSDP. Collectives: none at wrap time; all-gathers and
    reduce-scatters over ``dp_mesh`` during forward/backward.

    Mutates ``model`` in place (its class becomes ``FSDP<Class>``) and returns it.
    """
    units = plan_fsdp_units(model, reshard_after_forward=reshard_after_forward, pipelined=pipelined)
    offload = offload_policy if offload_policy is not None else OffloadPolicy()
    for unit in units:
        fully_shard(
            unit.module,
            mesh=dp_mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
    # The root's own parameters (final norm, tied embeddings) are needed again at once by backward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)
    if prefetch:
        _set_prefetch([u.module for u in units], forward_prefetch_depth, backward_prefetch_depth)
    return model


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


class FSDP2Manager:
    """Applies an `FSDP2Config` to a model: TP/SP, activation checkpointing, FSDP2 and compile.

    Config fields are copied to attributes (``manager.mp_policy``, ``manager.tp_plan``, ...), with
    ``mp_policy`` resolved to the default policy when the config left it ``None``. The config object is
    never modified.

    Args:
        config: The settings.
        device_mesh: The FSDP2 mesh from ``MeshContext.build(FSDP2Config(...))``; ``None`` only in a
            single process without a process group (nothing is sharded then).
        moe_mesh: The MoE mesh, kept for the expert-parallel parallelizer.

    Raises:
        ValueError: Not an `FSDP2Config`, a mesh of another layout, or no mesh with several ranks.
    """

    materialize_before_parallelize = False
    """FSDP2 shards meta models; weights are materialised and loaded after `parallelize`."""

    def __init__(
        self, config: FSDP2Config, device_mesh: DeviceMesh | None, moe_mesh: DeviceMesh | None = None
    ) -> None:
        if not isinstance(config, FSDP2Config):
            raise ValueError(f"FSDP2Manager needs an FSDP2Config, got {type(config).__name__}")
        self.config = config
        self.mesh = MeshContext.from_meshes(device_mesh, moe_mesh)
        if device_mesh is None:
            # A single process without a process group (what MeshContext.build returns there): nothing
            # to shard, but activation checkpointing and compile still apply.
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    "FSDP2Manager got device_mesh=None in a run of "
                    f"{dist.get_world_size()} ranks; build it with MeshContext.build(FSDP2Config(...))"
                )
        elif self.mesh.kind is not MeshKind.FSDP2:
            raise ValueError(
                "FSDP2Manager needs the FSDP2 mesh (pp, dp_replicate, dp_shard, cp, tp); build it with "
                f"MeshContext.build(FSDP2Config(...)), got axes {self.mesh.axis_names()}"
            )
        self.device_mesh = device_mesh
        self.moe_mesh = moe_mesh
        for name, value in config.to_dict().items():
            setattr(self, name, value)
        self.mp_policy: MixedPrecisionPolicy = (
            config.mp_policy if config.mp_policy is not None else default_mp_policy()
        )
        self.offload_policy: OffloadPolicy | None = _offload_for_host(config.offload_policy)
        host_buffers = self.mesh.device_type == "cpu" or self.offload_policy is not None
        if config.tune_host_allocator and device_mesh is not None and host_buffers:
            # Before the model is materialised: the setting applies to allocations made afterwards.
            from automodel_distributed.checkpoint.host_memory import configure_host_allocator

            configure_host_allocator()

    # ------------------------------------------------------------------ parallelize

    def _warn_ignored(self) -> None:
        cfg = self.config
        if cfg.sequence_parallel and self.mesh.tp_size == 1:
            warnings.warn("FSDP2Config.sequence_parallel is ignored: tp_size is 1", stacklevel=3)
        if cfg.tp_plan is not None and self.mesh.tp_size == 1:
            warnings.warn("FSDP2Config.tp_plan is ignored: tp_size is 1", stacklevel=3)
        if cfg.enable_async_tensor_parallel and self.mesh.tp_size == 1:
            warnings.warn("FSDP2Config.enable_async_tensor_parallel is ignored: tp_size is 1", stacklevel=3)
        if cfg.multimodal != MultimodalDistributedConfig():
            warnings.warn(
                "FSDP2Config.multimodal is ignored: automodel shards decoder language models; frozen "
                "multimodal towers stay in the root unit",
                stacklevel=3,
            )

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place and return it.

        Preconditions: ``model`` is a transformers-style decoder (blocks found from ``_no_split_modules``),
        on the meta device or on CPU/the target device; nothing is sharded yet. Mesh axes: ``tp`` for the
        TP plan, ``dp_shard_cp`` (and ``dp_replicate`` for HSDP) for FSDP. With a single rank (or a data-
        parallel mesh of size 1 and no TP) nothing is sharded, but activation checkpointing still applies.

        Raises:
            ValueError: Async TP on a host without CUDA, or a TP plan / head-count problem (before any
                collective).
        """
        cfg = self.config
        self._warn_ignored()
        tp_size = self.mesh.tp_size
        if cfg.enable_async_tensor_parallel and tp_size > 1 and self.mesh.device_type != "cuda":
            raise ValueError(
                "FSDP2Config.enable_async_tensor_parallel=True needs CUDA devices (symmetric memory); "
                "set it to False on CPU"
            )
        if cfg.patch_is_packed_sequence:
            _patch_is_packed_sequence()

        if tp_size > 1:
            from automodel_distributed.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(
                model,
                self.mesh.submesh(MeshAxisName.TP),
                tp_plan=cfg.tp_plan,
                sequence_parallel=cfg.sequence_parallel,
            )
        mode = resolve_checkpointing_mode(cfg.activation_checkpointing)
        if mode is not None:
            scope = cfg.activation_checkpointing_scope
            assert isinstance(scope, tuple), "FSDP2Config normalises the scope to a tuple"
            apply_activation_checkpointing(model, mode=mode, scope=scope)

        dp_size = self.mesh.dp_shard_cp_size * (self.mesh.dp_replicate_size or 1)
        if dp_size == 1:
            ignored = [
                name
                for name, active in (
                    ("mp_policy", self.mp_policy.param_dtype not in (None, torch.float32)),
                    ("offload_policy", self.offload_policy is not None),
                    ("enable_fsdp2_prefetch", cfg.enable_fsdp2_prefetch),
                    ("reshard_after_forward", cfg.reshard_after_forward is not None),
                )
                if active
            ]
            if ignored:
                warnings.warn(
                    f"FSDP2Config.{', FSDP2Config.'.join(ignored)} ignored: one data-parallel rank, so "
                    "nothing is sharded",
                    stacklevel=2,
                )
            return model
        apply_fsdp2(
            model,
            self.dp_mesh(),
            mp_policy=self.mp_policy,
            offload_policy=self.offload_policy,
            reshard_after_forward=cfg.reshard_after_forward,
            pipelined=self.mesh.pp_enabled,
            prefetch=cfg.enable_fsdp2_prefetch,
            forward_prefetch_depth=cfg.fsdp2_forward_prefetch_depth,
            backward_prefetch_depth=cfg.fsdp2_backward_prefetch_depth,
        )
        return model

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

    # ------------------------------------------------------------------ training-loop helpers

    def set_gradient_sync(self, model: nn.Module, *, is_last_microbatch: bool) -> None:
        """Before each micro-batch's backward: reduce gradients only on the last one when deferring.

        With ``defer_fsdp_grad_sync`` gradients accumulate unsharded-and-unreduced locally and are
        reduce-scattered once; otherwise every micro-batch reduces. Numerically the same either way.
        """
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(is_last_microbatch or not self.config.defer_fsdp_grad_sync)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Context for the forward pass: ``torch.autocast`` with ``autocast_dtype``, or nothing."""
        dtype = self.config.autocast_dtype
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=self.mesh.device_type, dtype=dtype):
            yield


def _patch_is_packed_sequence() -> None:
    # transformers inspects position_ids to detect packed sequences, which costs a device-to-host sync
    # per forward; the user asserted batches are never packed.
    import transformers.modeling_flash_attention_utils as fa_utils

    def _never_packed(*_args: Any, **_kwargs: Any) -> bool:
        return False

    fa_utils._is_packed_sequence = _never_packed
    logger.info("FSDP2: transformers' _is_packed_sequence patched to return False")
