"""Find the repeated transformer blocks of a model: the units of sharding, checkpointing and compile.

Blocks are found from what transformers declares (``_no_split_modules``, the class names of the blocks
that must stay whole), so no model family is named here. Models that declare nothing fall back to the
conventional block containers in `FALLBACK_BLOCK_CONTAINERS`. A multimodal tower whose block class is
declared nowhere (GOT-OCR2's vision encoder: only the language model's layer is in
``_no_split_modules``) gets its blocks from its own structure (`tower_blocks`: the children of the
outermost ``nn.ModuleList`` inside it whose entries are all one module class). Which layer group
(language, vision, audio, multimodal projector) a block belongs to is read from its FQN with the
markers in `LAYER_GROUP_MARKERS`; both tables are data, extended by adding entries.

Everything here only reads the model; nothing is mutated.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from torch import nn

from automodel_distributed.multimodal import LANGUAGE, PROJECTOR, ModelParts, model_parts
from automodel_modules import strip_wrapper_segments, unwrap

__all__ = [
    "FALLBACK_BLOCK_CONTAINERS",
    "LAYER_GROUP_MARKERS",
    "block_group",
    "blockless_parts",
    "blocks_in_scope",
    "find_transformer_blocks",
    "no_split_module_names",
    "tower_blocks",
]

logger = logging.getLogger(__name__)

FALLBACK_BLOCK_CONTAINERS: tuple[str, ...] = ("layers", "h", "blocks")
"""Names of ``nn.ModuleList`` attributes whose children are taken as blocks when the model declares no
``_no_split_modules`` (``model.layers`` in Llama-style models, ``transformer.h`` in GPT-2 style ones)."""

LAYER_GROUP_MARKERS: Mapping[str, tuple[str, ...]] = {
    "vision": (
        "vision_tower",
        "vision_model",
        "vision_encoder",
        "visual",
        "vit",
        "vit_model",
        "image_encoder",
        "vision",
    ),
    "audio": ("audio_tower", "audio_model", "audio_encoder", "speech_encoder", "audio"),
    "multimodal": (
        "multi_modal_projector",
        "multimodal_projector",
        "mm_projector",
        "connector",
        "merger",
    ),
}
"""Layer group -> FQN components that mark a block as belonging to it. A block whose FQN contains none
of them belongs to ``"language"``. Components are matched whole (``"visual"`` matches
``model.visual.blocks.0``, not ``model.visualizer.0``); the first group that matches wins."""

_SCOPE_GROUPS: Mapping[str, frozenset[str]] = {
    "language": frozenset({"language"}),
    "vision": frozenset({"vision"}),
    "audio": frozenset({"audio"}),
    # Everything that is not the language model: the towers and the projectors between them.
    "multimodal": frozenset({"vision", "audio", "multimodal"}),
}


def no_split_module_names(model: nn.Module) -> frozenset[str]:
    """Return the union of the ``_no_split_modules`` class names declared anywhere in ``model``.

    Looking at every sub-module (not only the root) finds the declaration of a peft-wrapped model (on its
    base model) and of composite models whose towers declare their own blocks.
    """
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            names.update(str(name) for name in declared)
    return frozenset(names)


def _blocks_by_class_name(model: nn.Module, class_names: frozenset[str]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    # The FQN prefix of the last block found: named_modules walks depth first, so its sub-modules (not
    # blocks themselves) come right after it, before any module outside it.
    inside = "\0"
    for fqn, module in model.named_modules():
        if fqn.startswith(inside):
            continue
        # The MRO, not just the class: fully_shard swaps a module's class for an FSDP subclass of it.
        if fqn and any(cls.__name__ in class_names for cls in type(unwrap(module)).__mro__):
            # A wrapper and the module it wraps both match; the first one seen (the outer) is the block.
            found.append((strip_wrapper_segments(fqn), module))
            inside = fqn + "."
    return found


def _blocks_by_container_name(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        leaf = fqn.rsplit(".", 1)[-1]
        if isinstance(module, nn.ModuleList) and leaf in FALLBACK_BLOCK_CONTAINERS:
            found.extend(
                (f"{strip_wrapper_segments(fqn)}.{name}", child) for name, child in module.named_children()
            )
    return found


def _repeated_children(module_list: nn.ModuleList) -> bool:
    # Lazily: the checkpoint package is not needed to find blocks by their declared classes.
    from automodel_checkpoint.convert import built_class

    children = list(module_list.children())
    return (
        len(children) > 0
        and len({built_class(unwrap(c)) for c in children}) == 1
        # A list of leaves (a stack of Linears) is not a list of blocks: a block has layers inside.
        and all(any(True for _ in unwrap(c).children()) for c in children)
    )


def tower_blocks(tower: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The repeated blocks of a tower, read from its structure: no declaration needed.

    They are the children of each outermost ``nn.ModuleList`` inside ``tower`` whose entries are all
    instances of one class with sub-modules of their own (a vision encoder's ``layers``; lists nested in
    such a block are parts of the block). Wrapped blocks are returned as the wrapper, under the
    unwrapped FQN, as in `find_transformer_blocks`. Reads only.

    Args:
        tower: The tower module.
        prefix: The tower's FQN in the model (prepended to the returned FQNs).

    Returns:
        ``(fqn, module)`` pairs in registration order; empty when the tower has no such list.
    """
    found: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for fqn, module in tower.named_modules():
        if any(fqn.startswith(p) for p in inside) or not isinstance(module, nn.ModuleList):
            continue
        if _repeated_children(module):
            base = strip_wrapper_segments(f"{prefix}.{fqn}" if prefix else fqn)
            found.extend((f"{base}.{name}", child) for name, child in module.named_children())
            inside.append(fqn + ".")
    return found


def _towers(parts: ModelParts) -> list[tuple[str, nn.Module]]:
    return [
        (fqn, module)
        for role, items in parts.parts.items()
        if role not in (LANGUAGE, PROJECTOR)
        for fqn, module in items
    ]


def _inside(fqn: str, prefix: str) -> bool:
    return fqn == prefix or fqn.startswith(prefix + ".")


def _with_undeclared_tower_blocks(
    model: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """``blocks`` with each tower's structural blocks (`tower_blocks`) where its declared ones fall short.

    A tower holding none of ``blocks`` gets its structural blocks. A tower whose declared blocks all lie
    strictly inside its structural blocks (Idefics2 declares its vision attention, not the encoder
    layer around it) gets the whole structural blocks instead, so a block unit or checkpoint covers
    the layer's MLP and norms too.
    """
    kept, extra = list(blocks), []
    for fqn, tower in _towers(model_parts(model)):
        prefix = strip_wrapper_segments(fqn)
        declared = [b for b, _ in kept if _inside(b, prefix)]
        if declared and not all(_inside(b, prefix) and b != prefix for b in declared):
            continue
        structural = tower_blocks(tower, fqn)
        if declared and not all(any(_inside(b, s) and b != s for s, _ in structural) for b in declared):
            continue  # the declared blocks are the layers (or lie outside every repeated list): keep them
        kept = [(b, m) for b, m in kept if not _inside(b, prefix)]
        extra.extend(structural)
    if not extra:
        return blocks
    # Back into module (forward) order.
    order = {id(module): i for i, module in enumerate(model.modules())}
    return sorted([*kept, *extra], key=lambda item: order[id(item[1])])


def find_transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the repeated transformer blocks of ``model`` with their FQNs, in forward order.

    Blocks are the sub-modules whose class, or a base class, has a name in the model's
    ``_no_split_modules`` (see `no_split_module_names`), so blocks stay blocks after ``fully_shard`` swaps
    their class for an FSDP subclass; sub-modules of a block are never blocks themselves. A block already
    wrapped by activation checkpointing (or compiled as a whole with ``torch.compile``) is returned as
    the wrapper, which is what its parent container holds, under the FQN of the unwrapped block (without
    ``_checkpoint_wrapped_module.``), so that applying a wrapper twice is easy to detect. peft-wrapped
    models work: their FQNs start with ``base_model.model.``. When the model declares no
    ``_no_split_modules`` (or none of the declared classes is present), the children of every
    ``nn.ModuleList`` named as in `FALLBACK_BLOCK_CONTAINERS` are taken instead. A multimodal tower
    (`automodel_distributed.multimodal.model_parts`) that holds none of the declared blocks adds the
    blocks its structure shows (`tower_blocks`); one whose declared blocks all lie inside those
    structural blocks (a declared attention module inside each encoder layer) takes the structural
    blocks instead.

    "Forward order" is module registration order, which is the order in which transformers decoders run
    their layers.

    Preconditions: none (meta-device models work; nothing is read from parameters).

    Args:
        model: Any ``nn.Module``, typically a transformers ``PreTrainedModel`` or a peft model.

    Returns:
        ``(fqn, module)`` pairs; the modules are the objects held by the parent containers.

    Raises:
        ValueError: No block was found; the message names the model class and how to declare its blocks.
    """
    declared = no_split_module_names(model)
    if declared:
        blocks = _blocks_by_class_name(model, declared)
        if blocks:
            return _with_undeclared_tower_blocks(model, blocks)
        logger.warning(
            "%s declares _no_split_modules %s but no sub-module has one of those classes; falling back to "
            "the block containers %s",
            type(model).__name__,
            sorted(declared),
            list(FALLBACK_BLOCK_CONTAINERS),
        )
    blocks = _blocks_by_container_name(model)
    if blocks:
        return blocks
    raise ValueError(
        f"found no transformer blocks in {type(model).__name__}: it declares no usable _no_split_modules "
        f"(got {sorted(declared)}) and has no nn.ModuleList named {list(FALLBACK_BLOCK_CONTAINERS)}. "
        f"Set `{type(model).__name__}._no_split_modules = ['YourBlockClassName']` (the class of the repeated "
        "layer) on the model class or instance."
    )


def block_group(fqn: str) -> str:
    """Return the layer group of a block FQN: ``vision``, ``audio``, ``multimodal`` or ``language``."""
    parts = set(strip_wrapper_segments(fqn).split("."))
    for group, markers in LAYER_GROUP_MARKERS.items():
        if parts.intersection(markers):
            return group
    return "language"


def _check_scope(scope: Iterable[str]) -> tuple[str, ...]:
    names = tuple(scope)
    unknown = [name for name in names if name != "all" and name not in _SCOPE_GROUPS]
    if not names or unknown:
        raise ValueError(
            f"activation-checkpointing scope {names!r} is not valid; use ('all',) or a tuple of "
            f"{sorted(_SCOPE_GROUPS)} (normalize strings with automodel_distributed.config."
            "normalize_activation_checkpointing_scope)"
        )
    if "all" in names and len(names) > 1:
        raise ValueError(f"activation-checkpointing scope {names!r}: 'all' cannot be combined with others")
    return names


def blocks_in_scope(model: nn.Module, scope: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Return the blocks of `find_transformer_blocks` whose layer group is in ``scope``.

    A block's group is the role of the model part holding it (`automodel_distributed.multimodal.model_parts`:
    the vision tower's blocks are ``vision``, a projector's ``multimodal``), else `block_group` of its FQN.

    Args:
        model: The model.
        scope: A normalised scope: ``("all",)`` or a tuple of ``language``, ``vision``, ``audio`` and
            ``multimodal`` (the last one meaning every block outside the language model).

    Returns:
        The selected ``(fqn, module)`` pairs in forward order (possibly empty).

    Raises:
        ValueError: The model has no blocks, or the scope is not normalised.
    """
    names = _check_scope(scope)
    blocks = find_transformer_blocks(model)
    if names == ("all",):
        return blocks
    wanted = frozenset().union(*(_SCOPE_GROUPS[name] for name in names))
    # The model's own parts (from its sub-configs) first; the FQN markers for models without them.
    parts = model_parts(model)

    def group(fqn: str) -> str:
        role = parts.role_of(fqn)
        if role is None or role not in (*_SCOPE_GROUPS, PROJECTOR):
            return block_group(fqn)
        return "multimodal" if role == PROJECTOR else role

    return [(fqn, module) for fqn, module in blocks if group(fqn) in wanted]


def blockless_parts(model: nn.Module, roles: Iterable[str]) -> list[tuple[str, str]]:
    """The parts of ``model`` with one of ``roles`` that hold no block of `find_transformer_blocks`.

    A tower listed here cannot be sharded per block nor checkpointed by block: callers refuse those
    settings for it (`automodel_distributed.fsdp2_units.plan_fsdp_units`,
    `automodel_distributed.activation_checkpointing.apply_activation_checkpointing`). Reads only.

    Returns:
        ``(role, fqn)`` pairs in module order (empty when every such part has blocks or none exists).
    """
    wanted = set(roles)
    parts = model_parts(model)
    found = [(role, fqn) for role, items in parts.parts.items() if role in wanted for fqn, _ in items]
    if not found:
        return []
    blocks = [fqn for fqn, _ in find_transformer_blocks(model)]
    return [
        (role, fqn) for role, fqn in found if not any(_inside(b, strip_wrapper_segments(fqn)) for b in blocks)
    ]
