"""Load a Hugging Face checkpoint straight into a (sharded) model: each rank reads only its slices.

Order of work, chosen so a bad checkpoint fails before it can do harm:

1. Resolve the files (folder, file or cached hub id) and read every header (`open_checkpoint`).
2. Match checkpoint keys to the model's tensors (`collect_tensor_slots`, key rules and mapping, then
   transformers' own conversion mapping: `convert.plan_conversions`, so a fused MoE ``experts.gate_up_proj``
   is described as a stack/concat of the per-expert checkpoint tensors) and check missing keys,
   unexpected keys, shapes and dtypes. All of this is metadata, identical on every rank.
3. Agree (an ``all_reduce`` of a failure flag): if any rank failed so far, every rank raises, and the
   model is untouched.
4. Materialise meta tensors and initialise those the checkpoint does not cover.
5. Each rank reads, for every tensor, exactly the boxes of its local shard (`tensor_boxes`) into the
   local tensor (byte ranges with ``preadv``; no collective). For a fused tensor each box is cut into the
   pieces of the checkpoint tensors it covers (`convert.pieces`): an expert-parallel rank reads only its
   own experts.
6. Agree again, so an error on one rank in steps 4-5 is raised on all; then verify that no tensor is
   left on meta or uninitialised.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint.convert import (
    Computed,
    Node,
    Source,
    compute,
    model_conversions,
    pieces,
    plan_conversions,
    sources,
)
from automodel_checkpoint.files import resolve_checkpoint
from automodel_checkpoint.keys import (
    DEFAULT_KEY_RULES,
    KeyRules,
    TensorSlot,
    apply_key_mapping,
    collect_tensor_slots,
)
from automodel_checkpoint.materialize import (
    default_device,
    has_meta_tensors,
    initializable_hf_model,
    initialize_model_weights,
    mark_needs_init,
    retie_weights,
    run_adapter_init,
    verify_materialized,
)
from automodel_checkpoint.ranks import agree_on_failure
from automodel_checkpoint.reader import CheckpointReader, open_checkpoint
from automodel_checkpoint.recomputed_buffers import (
    reinitialize_non_persistent_buffers,
    unrecomputable_buffers,
)
from automodel_checkpoint.slices import Box, tensor_boxes
from automodel_modules import is_dtensor, reshard_fsdp_units

__all__ = [
    "CheckpointMismatchError",
    "LoadReport",
    "check_hf_checkpoint",
    "load_base_model",
    "load_hf_checkpoint",
]

logger = logging.getLogger(__name__)

_SHOW = 20  # keys listed per category in an error message


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model: missing or unexpected keys, wrong shapes or dtypes.

    Attributes:
        missing: Model keys the checkpoint lacks.
        unexpected: Checkpoint keys the model has no tensor for.
        shape_mismatches: Key -> (checkpoint shape, model shape).
        dtype_mismatches: Key -> (checkpoint dtype, model dtype).
    """

    def __init__(
        self,
        where: str,
        missing: Sequence[str],
        unexpected: Sequence[str],
        shape_mismatches: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]],
        dtype_mismatches: Mapping[str, tuple[str, str]],
        model_class: str,
    ) -> None:
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.shape_mismatches = dict(shape_mismatches)
        self.dtype_mismatches = dict(dtype_mismatches)
        parts = [f"checkpoint {where} does not match {model_class}:"]

        def listing(items: Sequence[str]) -> str:
            more = f" ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
            return f"{list(items[:_SHOW])}{more}"

        if self.missing:
            parts.append(f"{len(self.missing)} missing key(s) {listing(self.missing)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected key(s) {listing(self.unexpected)}")
        if self.shape_mismatches:
            shown = [f"{k}: checkpoint {c} vs model {m}" for k, (c, m) in self.shape_mismatches.items()]
            parts.append(f"{len(shown)} shape mismatch(es) {listing(shown)}")
        if self.dtype_mismatches:
            shown = [f"{k}: checkpoint {c} vs model {m}" for k, (c, m) in self.dtype_mismatches.items()]
            parts.append(f"{len(shown)} dtype mismatch(es) {listing(shown)}")
        parts.append(
            "Check that the checkpoint is for this architecture and config; rename keys with "
            "key_mapping={regex: replacement}; pass strict=False to load a subset (missing tensors are "
            "then initialised, unexpected keys ignored; shapes and dtypes must still match)."
        )
        super().__init__("\n  ".join(parts))


@dataclass
class LoadReport:
    """What a load did on this rank.

    Attributes:
        checkpoint: The checkpoint folder.
        format: ``"safetensors"`` or ``"bin"``.
        loaded: Checkpoint keys loaded.
        missing: Model keys the checkpoint lacked (only non-empty with ``strict=False`` or ignored keys).
        unexpected: Checkpoint keys not used.
        cast: Key -> ``(checkpoint dtype, model dtype)`` for tensors converted on load.
        bytes_read: Bytes this rank read from the files.
        seconds: Wall time of the load on this rank.
    """

    checkpoint: Path
    format: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    cast: dict[str, tuple[str, str]] = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass
class _Plan:
    reader: CheckpointReader
    pairs: list[tuple[TensorSlot, Node]]
    report: LoadReport
    initialise: list[TensorSlot]
    model: nn.Module | None = None  # the transformers model, for computed conversions


def _ignored(key: str, patterns: Sequence[str] | None) -> bool:
    return any(re.search(p, key) for p in patterns or ())


def _dtype_problem(stored: torch.dtype, model: torch.dtype, allow_cast: bool) -> bool:
    if stored == model:
        return False
    return not (allow_cast and stored.is_floating_point and model.is_floating_point)


@dataclass
class _Matches:
    """The model's tensor slots against the checkpoint's sources (see `_match_slots`)."""

    pairs: list[tuple[TensorSlot, Node]] = field(default_factory=list)
    initialise: list[TensorSlot] = field(default_factory=list)
    claimed: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    dtypes: dict[str, tuple[str, str]] = field(default_factory=dict)


def _match_slots(
    slots: Sequence[TensorSlot],
    sources_of: Mapping[str, Node],
    reader: CheckpointReader,
    report: LoadReport,
    ignore_missing: Sequence[str] | None,
    allow_dtype_cast: bool,
) -> _Matches:
    """Pair each slot with its source: loaded, to initialise (absent), or a shape or dtype mismatch.

    Mutates ``report`` (the keys loaded and those cast on load).
    """
    match = _Matches()
    for slot in slots:
        present = [k for k in slot.keys if k in sources_of]
        match.claimed.update(s.key for k in present for s in sources(sources_of[k]))
        if not present:
            if not all(_ignored(k, ignore_missing) for k in slot.keys):
                match.missing.append(slot.keys[0])
            match.initialise.append(slot)
            continue
        key = present[0]
        node = sources_of[key]
        stored_dtypes = {reader.tensors[s.key].dtype for s in sources(node)}
        bad_dtype = next(
            (d for d in stored_dtypes if _dtype_problem(d, slot.tensor.dtype, allow_dtype_cast)), None
        )
        if node.shape != tuple(slot.tensor.shape):
            match.shapes[key] = (node.shape, tuple(slot.tensor.shape))
        elif bad_dtype is not None:
            match.dtypes[key] = (str(bad_dtype), str(slot.tensor.dtype))
        else:
            match.pairs.append((slot, node))
            report.loaded.append(key)
            cast = next((d for d in stored_dtypes if d != slot.tensor.dtype), None)
            if cast is not None:
                report.cast[key] = (str(cast), str(slot.tensor.dtype))
    return match


def _plan(
    model: nn.Module,
    path_or_repo_id: str | os.PathLike[str],
    *,
    strict: bool,
    allow_unexpected: bool,
    key_mapping: Mapping[str, str] | None,
    rules: KeyRules,
    allow_dtype_cast: bool,
    cache_dir: str | os.PathLike[str] | None,
    revision: str | None,
) -> _Plan:
    files = resolve_checkpoint(path_or_repo_id, cache_dir=cache_dir, revision=revision)
    reader = open_checkpoint(files)
    try:
        hf = initializable_hf_model(model)
        mapping = {**(getattr(hf, "_checkpoint_conversion_mapping", None) or {}), **(key_mapping or {})}
        renamed = apply_key_mapping(reader.tensors, mapping)  # key after key_mapping -> file key
        ignore_missing = getattr(hf, "_keys_to_ignore_on_load_missing", None)
        ignore_unexpected = getattr(hf, "_keys_to_ignore_on_load_unexpected", None)
        slots = collect_tensor_slots(model, rules)
        # transformers' own renamings and converters (fused MoE experts): model key -> source(s)
        conversions = plan_conversions(
            {k: reader.tensors[f].shape for k, f in renamed.items()},
            [k for slot in slots for k in slot.keys],
            model_conversions(hf),
            getattr(hf, "base_model_prefix", None),
            origin=renamed,
            dtypes={f: stored.dtype for f, stored in reader.tensors.items()},
            model=hf,
        )
        sources_of: dict[str, Node] = {
            k: Source(f, reader.tensors[f].shape) for k, f in conversions.direct.items()
        }
        sources_of.update(conversions.fused)
        report = LoadReport(files.root, files.format)
        match = _match_slots(slots, sources_of, reader, report, ignore_missing, allow_dtype_cast)
        _check_buffer_initializers(model)
        unexpected = sorted(
            k for k, f in renamed.items() if f not in match.claimed and not _ignored(k, ignore_unexpected)
        )
        report.missing, report.unexpected = match.missing, unexpected
        unexpected_error = strict and not allow_unexpected and bool(unexpected)
        if match.shapes or match.dtypes or (strict and match.missing) or unexpected_error:
            raise CheckpointMismatchError(
                str(files.root),
                match.missing if strict else [],
                unexpected if unexpected_error else [],
                match.shapes,
                match.dtypes,
                type(model).__name__,
            )
        return _Plan(reader, match.pairs, report, match.initialise, hf)
    except BaseException:
        reader.close()
        raise


def _check_buffer_initializers(model: nn.Module) -> None:
    """Fail now, before anything is written, if a meta non-persistent buffer could not be recomputed."""
    stuck = unrecomputable_buffers(model)
    if stuck:
        raise ValueError(
            f"cannot recompute the non-persistent buffers of {stuck} after materialisation: a fresh "
            "construction of the model does not have them and their modules are not constructible from "
            "their config alone. Register an initializer with "
            "automodel_checkpoint.register_buffer_initializer(ModuleClass, fn)."
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    if is_dtensor(t):
        return t.to_local().detach()
    return t.detach()


def _read_all(plan: _Plan) -> int:
    total = 0
    computed: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def position(node: Node) -> tuple[str, int]:
        stored = plan.reader.tensors[next(sources(node)).key]
        return str(stored.path), stored.entry.begin if stored.entry else 0

    # File by file, in file order: sequential reads, one open file at a time per rank.
    order = sorted(plan.pairs, key=lambda p: position(p[1]))
    with torch.no_grad():
        for slot, node in order:
            # Materialisation may have replaced the tensor the plan saw (buffers are new objects):
            # write into the one the model holds now.
            tensor = _current(slot)
            local = _local(tensor)
            _, boxes = tensor_boxes(tensor)
            if isinstance(node, Computed):
                key = (id(node.converter), node.layer_name)
                if key not in computed:  # every output of the converter at once (q, k and v, say)
                    whole = {}
                    for src in sources(node):
                        stored = plan.reader.tensors[src.key]
                        whole[src.key] = torch.empty(src.shape, dtype=stored.dtype, device="cpu")  # host
                        zero = (0,) * len(src.shape)
                        total += plan.reader.read(src.key, Box(zero, zero, src.shape), whole[src.key])
                    computed[key] = compute(node, whole, plan.model)
                full = computed[key][node.target]
                for box in boxes:
                    _box_of(local, box.local_start, box.shape).copy_(
                        _box_of(full, box.global_start, box.shape)
                    )
                mark_needs_init(tensor, False)
                continue
            for box in boxes:
                region = _box_of(local, box.local_start, box.shape)
                # A fused tensor's box touches only some of its sources (an EP rank's own experts).
                for piece in pieces(node, box.global_start, box.shape):
                    source_box = Box(piece.start, (0,) * len(piece.start), piece.shape)
                    total += plan.reader.read(piece.key, source_box, region[piece.index])
            mark_needs_init(tensor, False)
    return total


def _box_of(tensor: torch.Tensor, start: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    return tensor[tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))]


def _current(slot: TensorSlot) -> torch.Tensor:
    """The tensor ``slot`` names, as its first owner holds it now."""
    module, name = slot.owners[0]
    tensor = module._parameters[name] if slot.is_param else module._buffers[name]
    assert tensor is not None, f"{slot.fqns[0]} was removed from the model during the load"
    return tensor


def check_hf_checkpoint(
    model: nn.Module,
    path_or_repo_id: str | os.PathLike[str],
    *,
    strict: bool = True,
    key_mapping: Mapping[str, str] | None = None,
    allow_dtype_cast: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    rules: KeyRules = DEFAULT_KEY_RULES,
) -> LoadReport:
    """Check that a checkpoint fits ``model`` from metadata alone: no tensor is read, nothing is written.

    The same checks as `load_hf_checkpoint` (files, headers, index, keys, shapes, dtypes), without any
    collective, so a caller can reject a wrong checkpoint on every rank before it shards anything.
    ``model`` may be on the meta device.

    Returns:
        The `LoadReport` of what a load would read (``loaded``, ``missing``, ``unexpected``, ``cast``).

    Raises:
        FileNotFoundError: The checkpoint, a hub snapshot, or a shard named by the index is missing.
        CorruptCheckpointError: A truncated file, a corrupt header, or an index that disagrees.
        CheckpointMismatchError: Keys, shapes or dtypes do not fit.
        UnsupportedConversionError: A key needs a transformers conversion this loader cannot express.
    """
    plan = _plan(
        model,
        path_or_repo_id,
        strict=strict,
        allow_unexpected=False,
        key_mapping=key_mapping,
        rules=rules,
        allow_dtype_cast=allow_dtype_cast,
        cache_dir=cache_dir,
        revision=revision,
    )
    plan.reader.close()
    return plan.report


def load_hf_checkpoint(
    model: nn.Module,
    path_or_repo_id: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    strict: bool = True,
    allow_unexpected: bool = False,
    key_mapping: Mapping[str, str] | None = None,
    allow_dtype_cast: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    rules: KeyRules = DEFAULT_KEY_RULES,
    init_adapters: Callable[[nn.Module], object] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> LoadReport:
    """Load a Hugging Face checkpoint into ``model``, each rank reading only the slices it holds.

    ``model`` may be plain, wrapped (peft, activation checkpointing, compile), sharded (FSDP2, HSDP,
    TP, TP x FSDP: DTensor parameters of any ``Shard`` / ``_StridedShard`` / ``Replicate`` layout) and
    still on meta: meta tensors are then materialised on ``device`` and only the tensors the checkpoint
    does not cover are initialised (saving the cost of initialising what is about to be overwritten).

    Every check (files present, headers intact, index consistent, missing and unexpected keys, shapes,
    dtypes) runs from metadata before anything is written, identically on every rank. A tied weight
    counts as present when any of its names is in the checkpoint (a tied checkpoint without
    ``lm_head.weight`` is fine). Floating-point tensors are cast to the model's dtype (the dtype the
    model was built with is the intent; pass ``allow_dtype_cast=False`` to require an exact match);
    any other dtype difference is an error.

    Checkpoints whose layout differs from the model's in the way transformers describes with its weight
    conversion mapping (``get_model_conversion_mapping``: renamings, and ``MergeModulelist`` /
    ``Concatenate`` converters such as the per-expert MoE weights of Qwen3-MoE or Mixtral that the model
    keeps fused) load as with ``from_pretrained``, still slice by slice. A converter with another
    operation raises `convert.UnsupportedConversionError` (a ValueError naming it) before anything is
    written.

    Preconditions: parallelisms applied (load after ``FSDP2Manager.parallelize``); every rank of
    ``process_group`` calls this with the same checkpoint. Collectives over ``process_group`` (default:
    the world): an ``all_reduce`` of a failure flag after the checks and another after the reads (plus
    an ``all_gather_object`` of the messages when a rank failed), so a failure on any rank raises on all
    of them instead of hanging; DTensor random ops while initialising tensors the checkpoint lacks.
    FSDP2 modules are resharded first (no communication).

    Args:
        model: The model; its tensors are written in place (materialised first if on meta).
        path_or_repo_id: A checkpoint folder, a weight file, or a hub id already in the local cache.
        device: Where meta tensors are materialised; default: the device of the model's real tensors,
            else of its DTensor mesh (the current CUDA device for a CUDA mesh), else CPU. Pass
            ``"cpu"`` explicitly for FSDP2 CPU offload.
        strict: Missing and unexpected keys are errors (True) or only reported (False).
        allow_unexpected: Checkpoint keys the model lacks are only reported, even when ``strict``: for
            a model that holds part of the checkpoint (a pipeline stage). Missing keys still fail.
        key_mapping: Regex substitutions applied to the checkpoint's keys, in order.
        allow_dtype_cast: Allow floating-point dtype conversion on load.
        cache_dir: Hugging Face cache to look a hub id up in (default: ``HF_HUB_CACHE``).
        revision: Revision of a hub id.
        rules: Model-name rewrites (wrapper segments and prefixes, adapter markers).
        init_adapters: Initialiser of the model's LoRA adapters (``automodel_peft.init_adapter_weights``:
            their owner), called once after the base weights are read (DoRA magnitudes need them).
        process_group: Group whose ranks load together.

    Returns:
        This rank's `LoadReport`.

    Raises:
        FileNotFoundError: The checkpoint, a hub snapshot, or a shard named by the index is missing.
        CorruptCheckpointError: A file is truncated, its header is corrupt, or the index disagrees with it
            (a ValueError).
        CheckpointMismatchError: Keys, shapes or dtypes do not fit (a ValueError; lists the keys).
        ValueError: Another rank failed.
        RuntimeError: Some tensor is still on meta or uninitialised after the load.
    """
    start = time.perf_counter()
    plan: _Plan | None = None
    error: BaseException | None = None
    try:
        plan = _plan(
            model,
            path_or_repo_id,
            strict=strict,
            allow_unexpected=allow_unexpected,
            key_mapping=key_mapping,
            rules=rules,
            allow_dtype_cast=allow_dtype_cast,
            cache_dir=cache_dir,
            revision=revision,
        )
    except Exception as exc:  # shared with every rank below, so none is left waiting
        error = exc
    agree_on_failure(error, f"checking checkpoint {path_or_repo_id}", process_group)
    assert plan is not None
    error = None
    try:
        reshard_fsdp_units(model)
        if has_meta_tensors(model):
            dev = torch.device(device) if device is not None else default_device(model)
            initialize_model_weights(model, dev, skip_keys=plan.report.loaded, rules=rules)
        plan.report.bytes_read = _read_all(plan)
        run_adapter_init(model, init_adapters, rules)
    except Exception as exc:  # shared with every rank below, so none is left waiting
        error = exc
    finally:
        plan.reader.close()
    agree_on_failure(error, f"reading checkpoint {path_or_repo_id}", process_group)
    reinitialize_non_persistent_buffers(model, None)
    retie_weights(model)
    verify_materialized(model, rules)
    plan.report.seconds = time.perf_counter() - start
    if plan.report.missing or (plan.report.unexpected and not allow_unexpected):
        logger.warning(
            "loaded %s with %d missing key(s) %s and %d unexpected key(s) %s",
            plan.report.checkpoint,
            len(plan.report.missing),
            plan.report.missing[:_SHOW],
            len(plan.report.unexpected),
            plan.report.unexpected[:_SHOW],
        )
    if plan.report.cast:
        logger.info("cast %d tensor(s) to the model's dtype on load", len(plan.report.cast))
    return plan.report


def load_base_model(
    model: nn.Module,
    device: torch.device | str,
    root_dir: str | os.PathLike[str] | None,
    model_name: str | os.PathLike[str],
    load_base_model: bool = True,
    *,
    strict: bool = True,
    allow_unexpected: bool = False,
    key_mapping: Mapping[str, str] | None = None,
    init_adapters: Callable[[nn.Module], object] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """NeMo-AutoModel-compatible entry: load the base weights, recompute buffers, re-tie.

    Args:
        model: The model (possibly sharded, possibly on meta); mutated in place.
        device: Device for meta tensors.
        root_dir: Hugging Face cache folder for hub ids (None: ``HF_HUB_CACHE``).
        model_name: Checkpoint folder or hub id.
        load_base_model: False only materialises and initialises meta tensors, recomputes
            non-persistent buffers and re-ties weights (no checkpoint is read).
        strict: As in `load_hf_checkpoint`.
        allow_unexpected: As in `load_hf_checkpoint`.
        key_mapping: As in `load_hf_checkpoint`.
        init_adapters: As in `load_hf_checkpoint`.
        process_group: As in `load_hf_checkpoint`.

    Returns:
        ``model``.

    Raises:
        FileNotFoundError: As in `load_hf_checkpoint`.
        ValueError: As in `load_hf_checkpoint` (a mismatch, a corrupt file, another rank failed).
        RuntimeError: As in `load_hf_checkpoint`.
    """
    if load_base_model:
        load_hf_checkpoint(
            model,
            model_name,
            device=device,
            strict=strict,
            allow_unexpected=allow_unexpected,
            key_mapping=key_mapping,
            cache_dir=root_dir,
            init_adapters=init_adapters,
            process_group=process_group,
        )
        return model
    if has_meta_tensors(model):
        initialize_model_weights(model, device, init_adapters=init_adapters)
    reinitialize_non_persistent_buffers(model, None)
    retie_weights(model)
    verify_materialized(model)
    return model
