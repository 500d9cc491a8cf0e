"""Model tensors built from several checkpoint tensors, read from transformers' own conversion mapping.

transformers 5 keeps some weights fused in memory that checkpoints store apart: MoE experts are one
``experts.gate_up_proj`` ``[E, 2I, H]`` in the model but ``experts.{e}.gate_proj.weight`` and
``experts.{e}.up_proj.weight`` (``[I, H]`` each) on disk. transformers describes this as data
(``transformers.conversion_mapping.get_model_conversion_mapping``): renamings plus ``WeightConverter``s,
each a list of operations (``MergeModulelist`` stacks a list of tensors, ``Concatenate`` joins tensors).

Where we can, we do not run those operations on tensors. We run them on *descriptions*: a `Source` is
one checkpoint tensor, a `Stack` / `Cat` says how parts make up a bigger tensor, a `Part` is a slice of
one (``Chunk``: a fused ``query_key_value`` split into ``q_proj`` / ``k_proj`` / ``v_proj``). From the
description, `pieces` tells for any box of the model tensor (a rank's shard) which checkpoint tensors,
and which boxes of them, it needs, and where each lands: a rank that holds experts 4..7 reads only those
experts' bytes. Any other operation (interleaving, dequantisation, ...) is `Computed`: the loader reads
its source tensors whole and runs transformers' own converter on them (`compute`), then keeps its
shard; exact, at the cost of reading the whole sources on every rank. Its shape comes from running the
converter on meta tensors; a converter that cannot run there raises `UnsupportedConversionError`.

Key renaming itself is transformers' (``core_model_loading.rename_source_key``), so every renaming class
it has (prefix changes, capture groups, scoping to sub-models) behaves as in ``from_pretrained``.

Saving inverts the description: `disk_layout` asks transformers for the on-disk names and shapes of a
model (``revert_weight_conversion`` on meta tensors, so nothing is computed), describes them with the
same code as loading, and checks that they rebuild every model tensor exactly; each on-disk tensor is
then made of boxes of full model tensors (usually one box of one; a fused ``qkv`` that loading chunks
into three projections is the concatenation of all three).

Pure functions of names and shapes; nothing is read, mutated or communicated.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "Cat",
    "Computed",
    "ConversionPlan",
    "DiskPiece",
    "DiskTensor",
    "Node",
    "Part",
    "Piece",
    "Source",
    "Stack",
    "UnsupportedConversionError",
    "built_class",
    "compute",
    "compute_disk_tensors",
    "disk_layout",
    "model_conversions",
    "pieces",
    "plan_conversions",
    "sources",
]

logger = logging.getLogger(__name__)

Index = tuple[int | slice, ...]


class UnsupportedConversionError(ValueError):
    """A transformers weight conversion that this loader cannot express as slices of checkpoint tensors."""


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor, whole.

    Attributes:
        key: Its key in the checkpoint files.
        shape: Its shape.
    """

    key: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Stack:
    """Parts of equal shape stacked along a new dim ``dim`` (``torch.stack``)."""

    dim: int
    parts: tuple[Node, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Cat:
    """Parts joined along an existing dim ``dim`` (``torch.cat``)."""

    dim: int
    parts: tuple[Node, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Part:
    """The slice ``[start, start + size)`` of ``node`` along dim ``dim`` (one output of ``Chunk``)."""

    dim: int
    start: int
    node: Node
    shape: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Computed:
    """A model tensor that transformers' converter computes from whole checkpoint tensors.

    Attributes:
        converter: transformers' ``WeightConverter``.
        inputs: Source pattern -> the checkpoint tensors it gathered, in transformers' order.
        layer_name: The renamed key transformers passes as ``full_layer_name`` (its first target).
        target: The model key this node is (one of the converter's outputs).
        shape: Its shape (from running the converter on meta tensors).
    """

    converter: Any
    inputs: Mapping[str, tuple[Source, ...]]
    layer_name: str
    target: str
    shape: tuple[int, ...]


Node = Source | Stack | Cat | Part | Computed


@dataclass(frozen=True)
class Piece:
    """A box of one checkpoint tensor and where it lands in a requested box of a model tensor.

    Attributes:
        key: The checkpoint tensor.
        start: First index per dim of the box in the checkpoint tensor.
        shape: The box's shape.
        index: Indexes the requested box to give the destination view (ints where a dim was stacked).
    """

    key: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    index: Index


def _stack(dim: int, parts: Sequence[Node]) -> Stack:
    if not parts:
        raise ValueError("cannot stack an empty list of checkpoint tensors")
    first = parts[0].shape
    d = dim if dim >= 0 else dim + len(first) + 1
    odd = [_describe(p) for p in parts if p.shape != first]
    if odd or not 0 <= d <= len(first):
        raise ValueError(
            f"cannot stack checkpoint tensors along dim {dim}: {_describe(parts[0])} vs {odd[:3]}"
        )
    return Stack(d, tuple(parts), (*first[:d], len(parts), *first[d:]))


def _cat(dim: int, parts: Sequence[Node]) -> Cat:
    if not parts:
        raise ValueError("cannot concatenate an empty list of checkpoint tensors")
    first = parts[0].shape
    d = dim if dim >= 0 else dim + len(first)
    if not 0 <= d < len(first):
        raise ValueError(f"cannot concatenate {_describe(parts[0])} along dim {dim}")
    odd = [
        _describe(p)
        for p in parts
        if len(p.shape) != len(first) or p.shape[:d] != first[:d] or p.shape[d + 1 :] != first[d + 1 :]
    ]
    if odd:
        raise ValueError(
            f"cannot concatenate checkpoint tensors along dim {dim}: {_describe(parts[0])} vs {odd[:3]}"
        )
    size = sum(p.shape[d] for p in parts)
    return Cat(d, tuple(parts), (*first[:d], size, *first[d + 1 :]))


def _describe(node: Node) -> str:
    if isinstance(node, Source):
        return f"{node.key} {list(node.shape)}"
    if isinstance(node, Part):
        return f"part(dim={node.dim}, start={node.start}, of {_describe(node.node)})"
    if isinstance(node, Computed):
        return f"computed({node.target} {list(node.shape)})"
    kind = "stack" if isinstance(node, Stack) else "cat"
    return f"{kind}(dim={node.dim}, {len(node.parts)} parts, first {_describe(node.parts[0])})"


def sources(node: Node) -> Iterator[Source]:
    """Every checkpoint tensor of ``node``, in order."""
    if isinstance(node, Source):
        yield node
    elif isinstance(node, Part):
        yield from sources(node.node)
    elif isinstance(node, Computed):
        for found in node.inputs.values():
            yield from found
    else:
        for part in node.parts:
            yield from sources(part)


def pieces(node: Node, start: Sequence[int], shape: Sequence[int]) -> Iterator[Piece]:
    """The checkpoint boxes that make up the box ``[start, start + shape)`` of the tensor ``node`` describes.

    Args:
        node: The description.
        start: First index per dim of the requested box.
        shape: Its size per dim.

    Yields:
        One `Piece` per checkpoint tensor the box touches (parts outside the box are not yielded).
    """
    start, shape = tuple(start), tuple(shape)
    if any(n == 0 for n in shape):
        return
    if isinstance(node, Source):
        yield Piece(node.key, start, shape, tuple(slice(0, n) for n in shape))
        return
    if isinstance(node, Computed):
        raise TypeError(f"{_describe(node)} has no pieces: it is computed from whole tensors (compute)")
    d = node.dim
    if isinstance(node, Part):
        yield from pieces(node.node, (*start[:d], start[d] + node.start, *start[d + 1 :]), shape)
        return
    if isinstance(node, Stack):
        inner_start, inner_shape = start[:d] + start[d + 1 :], shape[:d] + shape[d + 1 :]
        for i in range(start[d], start[d] + shape[d]):
            for p in pieces(node.parts[i], inner_start, inner_shape):
                yield Piece(p.key, p.start, p.shape, (*p.index[:d], i - start[d], *p.index[d:]))
        return
    offset, lo_box, hi_box = 0, start[d], start[d] + shape[d]
    for part in node.parts:
        size = part.shape[d]
        lo, hi = max(lo_box, offset), min(hi_box, offset + size)
        if lo < hi:
            sub_start = (*start[:d], lo - offset, *start[d + 1 :])
            sub_shape = (*shape[:d], hi - lo, *shape[d + 1 :])
            shift = lo - lo_box
            for p in pieces(part, sub_start, sub_shape):
                at = p.index[d]
                moved = at + shift if isinstance(at, int) else slice(at.start + shift, at.stop + shift)
                yield Piece(p.key, p.start, p.shape, (*p.index[:d], moved, *p.index[d + 1 :]))
        offset += size


def model_conversions(model: nn.Module | None) -> list[Any]:
    """The weight transforms transformers has for ``model`` (renamings and converters), in order.

    Returns an empty list for a model that is not a transformers ``PreTrainedModel`` or has none.
    """
    if model is None or not callable(getattr(model, "is_custom_code", None)):
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    hf: Any = _as_built(model)  # a PreTrainedModel (checked above by duck typing)
    return list(get_model_conversion_mapping(hf) or [])


def built_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` was built with: FSDP2 swaps a sharded module's class for ``FSDP<Class>``."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrapper = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if wrapper is None or not isinstance(module, wrapper):
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, wrapper) and issubclass(c, nn.Module))


def _as_built(model: nn.Module) -> nn.Module:
    """``model`` under the class transformers built it with (`built_class`).

    transformers finds a model's conversions by class name first: a shallow copy (sharing every
    sub-module) with the original class keeps that lookup working. The model itself is not modified.
    """
    built = built_class(model)
    if built is type(model):
        return model
    # A bare instance sharing the model's attribute tables (copy.copy would call FSDP's constructor).
    view = object.__new__(built)
    view.__dict__.update(model.__dict__)
    return view


@dataclass
class ConversionPlan:
    """How checkpoint keys become model tensors.

    Attributes:
        direct: Model key -> checkpoint key, for tensors loaded as they are (possibly renamed).
        fused: Model key -> description of a tensor built from several checkpoint tensors.
        unmatched: Checkpoint keys that name no model tensor (after renaming).
    """

    direct: dict[str, str] = field(default_factory=dict)
    fused: dict[str, Node] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)


def _op_name(op: Any) -> str:
    return f"{type(op).__module__}.{type(op).__qualname__}"


def compute(
    node: Computed, tensors: Mapping[str, torch.Tensor], model: nn.Module | None
) -> dict[str, torch.Tensor]:
    """Run transformers' converter of ``node`` on whole checkpoint tensors.

    Args:
        node: The description.
        tensors: Checkpoint key -> the whole tensor, for every source of ``node``.
        model: The transformers model (some converters read its config or parameter shapes).

    Returns:
        Model key -> tensor, for every output of the converter (``node.target`` among them).
    """
    inputs = {p: [tensors[src.key] for src in found] for p, found in node.inputs.items()}
    return _run_converter(node.converter, inputs, node.layer_name, model)


def _run_converter(
    converter: Any, inputs: Mapping[str, Sequence[torch.Tensor]], layer_name: str, model: nn.Module | None
) -> dict[str, torch.Tensor]:
    for pattern, tensors in inputs.items():
        for i, tensor in enumerate(tensors):
            converter.add_tensor(layer_name, f"{pattern}.{i}", pattern, lambda t=tensor: t)
    view = _as_built(model) if model is not None else None
    out = converter.convert(layer_name, model=view, config=getattr(view, "config", None))
    return {str(k): v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _describe_converter(
    converter: Any,
    collected: Mapping[str, list[Source]],
    target: str,
    dtypes: Mapping[str, torch.dtype],
    model: nn.Module | None,
) -> dict[str, Node]:
    """Describe what ``converter`` makes of the checkpoint tensors it ``collected`` (by source pattern).

    Stacks, concatenations and chunks are described slice by slice; anything else is `Computed`.
    """
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist

    ops = list(converter.operations)
    targets = list(converter.target_patterns)
    if len(targets) == 1 and all(type(op) in (MergeModulelist, Concatenate) for op in ops):
        return {target: _merge(converter, collected, targets[0], target)}
    only = [src for found in collected.values() for src in found]
    if len(ops) == 1 and type(ops[0]) is Chunk and len(only) == 1 and ops[0].num_shards_attribute is None:
        # One tensor cut into equal chunks, one per target (a fused query_key_value, say).
        prefix, _, suffix = target.partition(targets[0])
        dim = ops[0].dim if ops[0].dim >= 0 else ops[0].dim + len(only[0].shape)
        bounds = torch.arange(only[0].shape[dim], device="cpu").chunk(len(targets))
        out: dict[str, Node] = {}
        for name, rows in zip(targets, bounds, strict=True):
            shape = (*only[0].shape[:dim], len(rows), *only[0].shape[dim + 1 :])
            out[prefix + name + suffix] = Part(dim, int(rows[0]) if len(rows) else 0, only[0], shape)
        return out
    return _computed(converter, collected, target, dtypes, model)


def _computed(
    converter: Any,
    collected: Mapping[str, list[Source]],
    target: str,
    dtypes: Mapping[str, torch.dtype],
    model: nn.Module | None,
) -> dict[str, Node]:
    """`Computed` nodes for every output of ``converter``, their shapes from a run on meta tensors."""
    meta = {
        pattern: [torch.empty(s.shape, dtype=dtypes.get(s.key, torch.float32), device="meta") for s in found]
        for pattern, found in collected.items()
    }
    try:
        outputs = _run_converter(converter, meta, target, model)
    except Exception as exc:
        raise UnsupportedConversionError(
            f"model tensor {target!r}: transformers converter {converter!r} (operations "
            f"{[_op_name(op) for op in converter.operations]}) cannot be described from the checkpoint's "
            f"shapes ({type(exc).__name__}: {exc}). Load this checkpoint with from_pretrained and save it "
            "with save_hf_checkpoint first."
        ) from None
    inputs = {pattern: tuple(found) for pattern, found in collected.items()}
    return {
        key: Computed(converter, inputs, target, key, tuple(tensor.shape)) for key, tensor in outputs.items()
    }


def _merge(converter: Any, collected: Mapping[str, list[Source]], pattern: str, target: str) -> Node:
    """Run a stack/concatenate converter's operations on descriptions instead of tensors."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    state: dict[str, Node | list[Node]] = {k: list(v) for k, v in collected.items()}
    for op in converter.operations:
        # Exact types: a subclass may change what convert() does.
        if type(op) is MergeModulelist:
            size = len(state)
            merged: dict[str, Node | list[Node]] = {}
            for name, value in state.items():
                merged[pattern if size == 1 else name] = (
                    value if not isinstance(value, list) else _stack(op.dim, value)
                )
            state = merged
        else:
            assert type(op) is Concatenate
            # In source-pattern order; a lone merged input was already renamed to the target by
            # MergeModulelist (a checkpoint lacking every tensor of one pattern): keep it, so the
            # result is a shape mismatch that names the model tensor.
            ordered = [p for p in converter.source_patterns if p in state] or list(state)
            parts: list[Node] = []
            for name in ordered:
                value = state[name]
                parts.extend(value if isinstance(value, list) else [value])
            state = {pattern: _cat(op.dim, parts)}
    values = list(state.values())
    if len(values) != 1:
        raise UnsupportedConversionError(
            f"model tensor {target!r}: {converter!r} leaves {len(values)} tensors, expected one"
        )
    value = values[0]
    if isinstance(value, list):
        if len(value) != 1:
            raise UnsupportedConversionError(
                f"model tensor {target!r}: {converter!r} leaves a list of {len(value)} tensors, expected one"
            )
        value = value[0]
    return value


def plan_conversions(
    keys: Mapping[str, tuple[int, ...]],
    model_keys: Sequence[str],
    transforms: Sequence[Any],
    base_model_prefix: str | None = None,
    origin: Mapping[str, str] | None = None,
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    model: nn.Module | None = None,
) -> ConversionPlan:
    """Match checkpoint keys to model keys with transformers' transforms, as ``from_pretrained`` does.

    Each key is renamed by every renaming and at most one converter
    (``transformers.core_model_loading.rename_source_key``); the ``base_model_prefix`` is added or
    dropped when that names a model key. A key the transforms rename to a non-model key, while the key
    itself is a model key, keeps its name (as transformers). Keys one converter gathers for one model
    key are ordered like transformers orders them (natural order: expert 2 before expert 10).

    Args:
        keys: Checkpoint key -> shape.
        model_keys: Every model key (checkpoint names of the model's tensors).
        transforms: From `model_conversions`.
        base_model_prefix: The model's ``base_model_prefix`` (e.g. ``"model"``).
        origin: Key -> the key to record in the plan (the file's own key when ``keys`` were renamed by
            a user ``key_mapping`` first); default: the key itself.
        dtypes: Checkpoint key (after ``origin``) -> stored dtype, for converters that are computed.
        model: The transformers model, for converters that read its config or parameter shapes.

    Returns:
        The plan (its checkpoint keys are ``origin``'s values).

    Raises:
        UnsupportedConversionError: A converter that checkpoint keys need uses an operation that cannot
            be described (the message names it).
        ValueError: The gathered tensors cannot be stacked or concatenated (their shapes disagree).
    """
    plan = ConversionPlan()
    own = origin or {}
    if not transforms:
        known = set(model_keys)
        for key in keys:
            if key in known:
                plan.direct[key] = own.get(key, key)
            else:
                plan.unmatched.append(own.get(key, key))
        return plan
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    # transformers' lookups only test `.get(key) is not None`
    lookup: dict[str, bool] = dict.fromkeys(model_keys, True)
    gathered: dict[str, tuple[Any, dict[str, list[Source]]]] = {}
    unmatched: list[str] = []
    for key in sorted(keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, base_model_prefix, lookup)
        if renamed not in lookup and key in lookup:
            renamed, pattern = key, None
        if renamed not in lookup:
            unmatched.append(key)
        elif pattern is None:
            if renamed in plan.direct:
                raise ValueError(
                    f"checkpoint keys {plan.direct[renamed]!r} and {own.get(key, key)!r} both name model "
                    f"tensor {renamed!r} after transformers' renamings; remove one from the checkpoint"
                )
            plan.direct[renamed] = own.get(key, key)
        else:
            converter, collected = gathered.setdefault(renamed, (by_pattern[pattern], {}))
            collected.setdefault(pattern, []).append(Source(own.get(key, key), tuple(keys[key])))
    for target, (converter, collected) in gathered.items():
        try:
            plan.fused.update(_describe_converter(converter, collected, target, dtypes or {}, model))
        except UnsupportedConversionError:
            raise
        except ValueError as exc:
            counts = {pattern: len(found) for pattern, found in collected.items()}
            raise ValueError(
                f"model tensor {target!r} cannot be built from its checkpoint tensors (found per pattern: "
                f"{counts}): {exc}. Is an expert missing from the checkpoint, or is it for another config?"
            ) from None
    uncovered = [k for k in model_keys if k not in plan.direct and k not in plan.fused]
    if unmatched and uncovered and model is not None:
        for model_key, key in _saved_names(model, uncovered, set(unmatched)).items():
            plan.direct[model_key] = own.get(key, key)
            unmatched.remove(key)
    plan.unmatched.extend(own.get(key, key) for key in unmatched)
    return plan


def _saved_names(model: nn.Module, model_keys: Sequence[str], candidates: set[str]) -> dict[str, str]:
    """Model key -> the checkpoint key ``save_pretrained`` writes for it, where that is a candidate.

    transformers' load renamings do not always invert its save renamings: a Gemma 3 model holding a
    ShieldGemma 2 config saves its language model as ``model.language_model.model.*`` and, on load,
    first applies ShieldGemma 2's prefix change (meant for the classifier that wraps that model), so
    ``from_pretrained`` reports those tensors missing and initialises them anew. transformers' own save
    direction (``revert_weight_conversion``, on meta tensors) names the key that holds each of them.
    Only renamings are taken: a renamed tensor comes back as the very object that went in, a converted
    one (split, fused) does not.
    """
    from transformers.core_model_loading import revert_weight_conversion

    hf: Any = _as_built(model)
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    probes = {key: torch.empty(shapes.get(key, (1,)), device="meta") for key in model_keys}
    saved = revert_weight_conversion(hf, dict(probes))
    by_tensor = {id(tensor): key for key, tensor in saved.items()}
    found = {
        key: by_tensor[id(probe)] for key, probe in probes.items() if by_tensor.get(id(probe)) in candidates
    }
    if found:
        logger.info(
            "%d tensors of %s load from the keys save_pretrained writes for them, which transformers' "
            "load renamings do not map back (e.g. %s <- %s)",
            len(found),
            type(model).__name__,
            *next(iter(found.items())),
        )
    return found


def _sliceable(node: Node) -> bool:
    if isinstance(node, Computed):
        return False
    if isinstance(node, Part):
        return _sliceable(node.node)
    return isinstance(node, Source) or all(_sliceable(p) for p in node.parts)


@dataclass(frozen=True)
class DiskPiece:
    """A box of one on-disk tensor taken from a box of one model tensor.

    Attributes:
        model_key: The model tensor.
        index: Indexes the full model tensor to give the box (None: the whole tensor).
        start: First index per dim of the box in the on-disk tensor.
        shape: The box's shape.
    """

    model_key: str
    index: Index | None
    start: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DiskTensor:
    """One tensor of the on-disk layout, made of boxes of model tensors.

    Most are one box of one model tensor (a whole tensor, or one expert of a fused ``gate_up_proj``); a
    tensor that transformers splits on load (a fused ``qkv`` chunked into ``q_proj`` / ``k_proj`` /
    ``v_proj``) is the concatenation of boxes of several.

    Attributes:
        key: Its key on disk.
        shape: Its shape.
        pieces: The boxes it is made of, covering it exactly.
    """

    key: str
    shape: tuple[int, ...]
    pieces: tuple[DiskPiece, ...]
    computed: tuple[str, ...] = ()
    """Set instead of ``pieces`` for a tensor transformers computes on saving (an interleave, a
    transpose, ...): the model tensors whose full values `compute_disk_tensors` turns into it."""

    @property
    def model_keys(self) -> tuple[str, ...]:
        """The model tensors it reads, in order of first use."""
        return self.computed or tuple(dict.fromkeys(p.model_key for p in self.pieces))

    @property
    def whole(self) -> str | None:
        """The model key when this tensor is exactly one whole model tensor (no copy needed)."""
        if self.computed:
            return None
        (first, *rest) = self.pieces
        return first.model_key if not rest and first.index is None else None


def compute_disk_tensors(model: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The on-disk tensors transformers' reverted conversions compute from the full model tensors ``full``.

    ``full`` holds one `DiskTensor.computed` group: every model tensor those on-disk tensors need.
    """
    from transformers.core_model_loading import revert_weight_conversion

    hf: Any = _as_built(model)
    return dict(revert_weight_conversion(hf, dict(full)))


def _computed_groups(plan: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, ...]]:
    """On-disk key -> the model keys computed from it and the on-disk keys they share (a component)."""
    reads = {key: {s.key for s in sources(node)} for key, node in plan.fused.items() if not _sliceable(node)}
    groups: list[tuple[set[str], set[str]]] = []  # (model keys, on-disk keys)
    for key, disk_keys in reads.items():
        joined = [g for g in groups if g[1] & disk_keys]
        merged = ({key}, set(disk_keys))
        for group in joined:
            groups.remove(group)
            merged[0].update(group[0])
            merged[1].update(group[1])
        groups.append(merged)
    order = list(shapes)
    return {
        disk_key: tuple(sorted(model_keys, key=order.index))
        for model_keys, disk_keys in groups
        for disk_key in disk_keys
    }


def disk_layout(model: nn.Module | None, shapes: Mapping[str, tuple[int, ...]]) -> list[DiskTensor] | None:
    """The tensors ``save_pretrained`` would write, each as boxes of model tensors.

    Asks transformers for the on-disk names and shapes (``revert_weight_conversion`` on meta tensors: it
    uses the transforms the model was loaded with, else its registered ones), then describes them with
    `plan_conversions` (the loading direction) and inverts that: every piece that loading reads from an
    on-disk tensor is, on saving, a box of that on-disk tensor taken from the model tensor. It checks that
    the description rebuilds exactly the model's keys and shapes, and that the boxes of each on-disk
    tensor cover it exactly.

    Args:
        model: The transformers model (None: no conversion).
        shapes: Model key -> shape, for every tensor to save.

    Returns:
        The on-disk tensors, in the order of the model tensors they come from; None when the model has
        no conversions.

    Raises:
        ValueError: transformers' reverted layout does not rebuild the model's tensors (a bug to report:
            the message names the keys).
    """
    if model is None or not callable(getattr(model, "is_custom_code", None)):
        return None
    from transformers.core_model_loading import revert_weight_conversion

    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    hf: Any = _as_built(model)
    reverted = revert_weight_conversion(hf, dict(meta))
    if set(reverted) == set(meta) and all(tuple(reverted[k].shape) == shapes[k] for k in shapes):
        return None
    disk_shapes = {k: tuple(t.shape) for k, t in reverted.items()}
    plan = plan_conversions(
        disk_shapes,
        list(shapes),
        model_conversions(model),
        getattr(model, "base_model_prefix", None),
        dtypes={k: t.dtype for k, t in reverted.items()},
        model=model,
    )
    computed = _computed_groups(plan, shapes)
    covered = set(plan.direct) | set(plan.fused)
    wrong = sorted(set(shapes) ^ covered)
    wrong += sorted(k for k, node in plan.fused.items() if node.shape != shapes[k])
    wrong += sorted(k for k, d in plan.direct.items() if disk_shapes[d] != shapes[k])
    if wrong or plan.unmatched:
        raise ValueError(
            f"transformers' on-disk layout of {type(model).__name__} does not rebuild the model: keys "
            f"{wrong[:10]} and unmatched on-disk keys {plan.unmatched[:10]}"
        )
    boxes: dict[str, list[DiskPiece]] = {}
    order: dict[str, None] = {}  # on-disk keys in the order of the model tensors they come from
    for key, shape in shapes.items():
        if key in plan.direct:
            boxes.setdefault(plan.direct[key], []).append(DiskPiece(key, None, (0,) * len(shape), shape))
            order[plan.direct[key]] = None
        elif not _sliceable(plan.fused[key]):
            order.update(dict.fromkeys(sorted(d for d, group in computed.items() if key in group)))
        else:
            for p in pieces(plan.fused[key], (0,) * len(shape), shape):
                boxes.setdefault(p.key, []).append(DiskPiece(key, p.index, p.start, p.shape))
                order[p.key] = None
    mixed = sorted(set(boxes) & set(computed))
    if mixed:
        raise UnsupportedConversionError(
            f"saving {type(model).__name__} in transformers' on-disk layout: {mixed[:5]} would be both "
            "sliced from model tensors and computed by a converter; save it with save_pretrained from one "
            "process"
        )
    # Boxes inside the tensor whose volumes add up to it cover it exactly: transformers' chunks and
    # stacks never overlap, so a gap would show as a missing volume.
    uncovered = [
        key
        for key, found in boxes.items()
        if sum(math.prod(b.shape) for b in found) != math.prod(disk_shapes[key])
        or any(
            s + n > size for b in found for s, n, size in zip(b.start, b.shape, disk_shapes[key], strict=True)
        )
    ]
    if uncovered or set(boxes) | set(computed) != set(disk_shapes):
        raise ValueError(
            f"transformers' on-disk layout of {type(model).__name__} is not covered by the model's tensors: "
            f"{sorted(uncovered)[:10]}, absent {sorted(set(disk_shapes) - set(boxes) - set(computed))[:10]}"
        )
    return [
        DiskTensor(key, disk_shapes[key], tuple(boxes.get(key, ())), computed.get(key, ())) for key in order
    ]
