"""Which modules of a model become FSDP2 units, and how they reshard: a plan, before anything is sharded.

`plan_fsdp_units` reads the model (its input embedding, transformer blocks and output head, its frozen
multimodal towers) and returns `FSDPUnitPlan` entries; `automodel_distributed.fsdp2.apply_fsdp2` applies
them, and planners (`automodel_distributed.memory`, ``automodel plan``) read them. Nothing is mutated and
no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from automodel_distributed.blocks import blockless_parts, find_transformer_blocks
from automodel_distributed.multimodal import LANGUAGE, PROJECTOR, model_parts
from automodel_modules import embedding_module, fqn_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FrozenSharding

__all__ = [
    "FSDPUnitPlan",
    "check_frozen_sharding",
    "frozen_towers",
    "needs_no_weight_in_backward",
    "output_head",
    "plan_fsdp_units",
]


@dataclass(frozen=True)
class FSDPUnitPlan:
    """One module that becomes its own FSDP unit, and how it is sharded.

    Attributes:
        fqn: Its name in the model.
        module: The module.
        reshard_after_forward: Free the gathered parameters after forward (an int: reshard to that
            smaller world). ``None`` (extra units only): as the dense unit that contains it.
        mesh: The mesh it is sharded over; ``None``: the data-parallel mesh of `apply_fsdp2`.
        shard_placement_fn: ``fully_shard``'s per-parameter placement (e.g. ``Shard(1)``); ``None``: dim 0.
        gradient_divide_factor: Divide the reduced gradient by this instead of the unit mesh's size (a
            unit on its own mesh whose gradients hold other ranks' contributions, like experts).
        mp_policy: The unit's mixed precision; ``None``: the applier's.
        unshard_in_backward: False when backward needs none of the unit's parameters (a plain
            ``nn.Embedding``: its gradient comes from the token ids alone), so FSDP skips its all-gather
            in backward (``FSDPModule.set_unshard_in_backward``).
    """

    fqn: str
    module: nn.Module
    reshard_after_forward: bool | int | None
    mesh: DeviceMesh | None = None
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None
    gradient_divide_factor: float | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    unshard_in_backward: bool = True


def needs_no_weight_in_backward(module: nn.Module) -> bool:
    """A plain ``nn.Embedding`` (its own ``forward``): backward reads the token ids, never the weight.

    A subclass with its own forward (fake quantization, scaling) or a wrapper (a LoRA embedding, whose
    adapter gradients need the adapter weights) may read them. An instance-level ``forward`` (the tied
    embedding of `automodel_distributed.tied_embedding`) does not change the class's.
    """
    return isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward


def _is_tied(model: nn.Module) -> bool:
    weight = getattr(embedding_module(model, "input"), "weight", None)
    return weight is not None and weight is getattr(embedding_module(model, "output"), "weight", None)


def _holds_parameters(module: nn.Module) -> bool:
    """A module with parameters (not a pipeline stage's stand-in for another stage's module)."""
    return any(True for _ in module.parameters())


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's untied output head (``get_output_embeddings()``) when it holds parameters, or None."""
    head = embedding_module(model, "output")
    return head if head is not None and _holds_parameters(head) and not _is_tied(model) else None


def frozen_towers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The parts of a multimodal model outside its language model whose parameters are all frozen.

    Parts come from `automodel_distributed.multimodal.model_parts` (the model's sub-configs): a frozen
    vision tower, audio tower or projector. Reads only.
    """
    parts = model_parts(model)
    return [
        (fqn, module)
        for role, found in parts.parts.items()
        if role != LANGUAGE
        for fqn, module in found
        if any(True for _ in module.parameters()) and not any(p.requires_grad for p in module.parameters())
    ]


def check_frozen_sharding(model: nn.Module, frozen_sharding: FrozenSharding) -> None:
    """Refuse ``per_layer`` for a frozen tower that has no repeated blocks to make units of.

    Such a tower (no class of ``_no_split_modules`` inside it and no ``nn.ModuleList`` of blocks,
    `automodel_distributed.blocks.tower_blocks`) would otherwise silently stay in the root unit. Reads
    only; no collective.

    Raises:
        ValueError: ``frozen_sharding="per_layer"`` and such a tower is frozen (names the towers).
    """
    if frozen_sharding != "per_layer":
        return
    frozen = {fqn for fqn, _ in frozen_towers(model)}
    if not frozen:
        return
    roles = [role for role in model_parts(model).parts if role not in (LANGUAGE, PROJECTOR)]
    bare = [fqn for _, fqn in blockless_parts(model, roles) if fqn in frozen]
    if bare:
        raise ValueError(
            f"FSDP2Config.multimodal.frozen_sharding='per_layer': the frozen tower(s) {bare} of "
            f"{type(model).__name__} have no repeated blocks to shard one by one (no class of "
            "`_no_split_modules` inside them and no nn.ModuleList of blocks); use frozen_sharding='root' "
            "or 'replicate', or add the tower's block class to the model's `_no_split_modules`"
        )


def plan_fsdp_units(
    model: nn.Module,
    *,
    reshard_after_forward: bool | int | None,
    pipelined: bool = False,
    frozen_sharding: FrozenSharding = "per_layer",
) -> list[FSDPUnitPlan]:
    """Decide the dense FSDP units of a model, in forward order, without touching it.

    Units: the input embedding (when untied), every transformer block, the LM head (when untied). The
    root unit (final norm and whatever is left) is added by `apply_fsdp2`. Tied embeddings stay in the
    root so the shared weight lives in exactly one unit. The blocks of a frozen tower (`frozen_towers`)
    are units only with ``frozen_sharding="per_layer"``; with ``"root"`` they join the root unit and
    with ``"replicate"`` `apply_fsdp2` keeps them out of FSDP.

    ``reshard_after_forward=None`` applies the usual heuristic: reshard every unit after forward except
    the last ones to run (the last block and the LM head), whose parameters backward needs at once; under
    pipelining nothing reshards, since each micro-batch's backward follows soon after its forward. An
    untied plain ``nn.Embedding`` (its backward reads the token ids, not the weight) reshards after
    forward under any setting outside a pipeline: nothing would be saved by keeping it.

    Raises:
        ValueError: ``per_layer`` for a frozen tower without blocks (`check_frozen_sharding`).
    """
    check_frozen_sharding(model, frozen_sharding)
    units: list[tuple[str, nn.Module]] = []
    embed = None if _is_tied(model) else embedding_module(model, "input")
    head = output_head(model)
    if embed is not None and _holds_parameters(embed) and (fqn := fqn_of(model, embed)):
        units.append((fqn, embed))
    blocks = find_transformer_blocks(model)
    if frozen_sharding != "per_layer":
        towers = [fqn for fqn, _ in frozen_towers(model)]
        blocks = [(f, m) for f, m in blocks if not any(f.startswith(t + ".") for t in towers)]
    units.extend(blocks)
    if head is not None and (fqn := fqn_of(model, head)):
        units.append((fqn, head))

    def policy(index: int) -> bool | int:
        if reshard_after_forward is not None:
            return reshard_after_forward
        if pipelined:
            return False
        is_last_block = index == len(units) - 1 or (head is not None and index == len(units) - 2)
        return not is_last_block

    plans = [FSDPUnitPlan(fqn, module, policy(i)) for i, (fqn, module) in enumerate(units)]
    if plans and plans[0].module is embed and needs_no_weight_in_backward(embed):
        # Its backward gathers nothing, and FSDP reshards every unit after its backward anyway, so
        # outside a pipeline (whose micro-batches keep units gathered from one forward to the next)
        # keeping it gathered after forward saves no all-gather and holds the whole table all step.
        reshard = plans[0].reshard_after_forward if pipelined else True
        plans[0] = replace(plans[0], unshard_in_backward=False, reshard_after_forward=reshard)
    return plans
