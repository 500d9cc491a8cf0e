"""Registry of Hugging Face MoE families: where the experts live and how their weights are laid out.

Each family is one `MoEFamily` record (data, no code). Register more with `register_moe_family`.
Only the experts computation is replaced; the sparse block's own forward (router, top-k, normalisation,
shared experts, router logits for the aux loss) runs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

__all__ = ["MOE_FAMILIES", "MoEFamily", "find_moe_family", "iter_sparse_blocks", "register_moe_family"]


@dataclass(frozen=True, kw_only=True)
class MoEFamily:
    """Where a transformers MoE family keeps its experts and how they are stored.

    The experts module must be called as ``experts(hidden_states [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H]`` (the transformers 5 fused-experts convention).
    """

    model_type: str
    """``config.model_type`` of the family (e.g. ``"qwen3_moe"``)."""
    sparse_block_class: str
    """Class name of the sparse MoE block that owns the router and the experts."""
    num_experts_field: str
    """Config field holding the number of routed experts."""
    experts_attr: str = "experts"
    """Attribute of the sparse block holding the fused experts module."""
    router_attr: str = "gate"
    """Attribute of the sparse block holding the router (kept as is)."""
    gate_up_param: str = "gate_up_proj"
    """Fused gate+up weight, ``[E, 2*I, H]`` (gate rows first, then up), applied as ``F.linear``."""
    down_param: str = "down_proj"
    """Down weight, ``[E, H, I]``, applied as ``F.linear``."""
    act_fn_attr: str = "act_fn"
    """Attribute of the experts module holding the activation applied to the gate half."""


MOE_FAMILIES: dict[str, MoEFamily] = {}
"""model_type -> `MoEFamily`."""


def register_moe_family(family: MoEFamily, *, overwrite: bool = False) -> MoEFamily:
    """Register ``family`` (one call); ``ValueError`` if its model_type exists and not ``overwrite``."""
    if not isinstance(family, MoEFamily):
        raise ValueError(f"register_moe_family needs a MoEFamily, got {type(family).__name__}")
    if family.model_type in MOE_FAMILIES and not overwrite:
        raise ValueError(f"MoE family {family.model_type!r} is already registered; pass overwrite=True")
    MOE_FAMILIES[family.model_type] = family
    return family


for _family in (
    MoEFamily(
        model_type="qwen3_moe", sparse_block_class="Qwen3MoeSparseMoeBlock", num_experts_field="num_experts"
    ),
    MoEFamily(
        model_type="qwen2_moe", sparse_block_class="Qwen2MoeSparseMoeBlock", num_experts_field="num_experts"
    ),
    MoEFamily(
        model_type="mixtral",
        sparse_block_class="MixtralSparseMoeBlock",
        num_experts_field="num_local_experts",
    ),
):
    register_moe_family(_family)


def find_moe_family(model: nn.Module) -> MoEFamily:
    """Return the registered family of ``model`` (from ``model.config.model_type``).

    Raises:
        ValueError: No family is registered for the model's type; the message says how to register one.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = MOE_FAMILIES.get(str(model_type))
    if family is None:
        raise ValueError(
            f"no MoE family is registered for model_type={model_type!r} ({type(model).__name__}); known: "
            f"{sorted(MOE_FAMILIES)}. Register one with automodel_moe.register_moe_family(MoEFamily("
            f"model_type={model_type!r}, sparse_block_class='<SparseMoeBlock class>', "
            "num_experts_field='<config field>', ...))"
        )
    return family


def iter_sparse_blocks(model: nn.Module, family: MoEFamily) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(fqn, block)`` for every sparse MoE block of ``family`` in ``model``."""
    for fqn, module in model.named_modules():
        if type(module).__name__ == family.sparse_block_class:
            yield fqn, module
