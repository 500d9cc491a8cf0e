"""`resolve_tp_plan`: choose a model's tensor-parallel plan, without side effects or collectives."""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from automodel_distributed.tensor_parallel._fqn import match_modules, param_module_names
from automodel_distributed.tensor_parallel.block_input import with_summed_block_inputs
from automodel_distributed.tensor_parallel.derived import derived_tp_plan
from automodel_distributed.tensor_parallel.hf_plan import module_fqn, translate_hf_tp_plan
from automodel_distributed.tensor_parallel.lora import expand_lora_plan, is_lora_linear
from automodel_distributed.tensor_parallel.plans import (
    DEFAULT_DECODER_PLAN,
    DEFAULT_DECODER_SP_PLAN,
    HF_TP_PLAN_SUPPLEMENTS,
    INEXACT_HF_TP_PLANS,
)
from automodel_distributed.tensor_parallel.registry import (
    PlanMapping,
    PlanSource,
    check_plan_mapping,
    named_plan,
    named_plan_names,
    registered_plan_for,
)
from automodel_distributed.tensor_parallel.sequence import (
    SequenceLength,
    check_sequence_stream,
    sequence_parallel_blocks,
)
from automodel_distributed.tensor_parallel.styles import to_parallel_style
from automodel_distributed.tensor_parallel.validate import validate_tensor_parallel
from automodel_modules import embedding_module, find_hf_model, join_fqn, stream_continues

__all__ = ["is_sequence_parallel_plan", "resolve_tp_plan", "sharded_layer_kinds"]

logger = logging.getLogger(__name__)

_HOW_TO_REGISTER = (
    "Give it a plan in one of these ways: "
    "automodel_distributed.tensor_parallel.register_tp_plan(<class or class name>, {fqn_pattern: style}, "
    "sequence_parallel_plan={...}); or FSDP2Config(tp_plan=...) / apply_tensor_parallel(tp_plan=...) with a "
    "dict, a name registered with register_named_tp_plan(name, plan), or an import path 'pkg.module.PLAN' to "
    "a dict or to a function returning one."
)


def _check_tp_size(tp_size: object) -> int:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    return tp_size


def _is_factory(source: object) -> bool:
    return callable(source) and not isinstance(source, Mapping)


def _call_factory(source: PlanSource, model: nn.Module, sequence_parallel: bool, what: str) -> PlanMapping:
    if isinstance(source, Mapping):
        return source
    plan = source(model, sequence_parallel)
    check_plan_mapping(plan, what=what)
    return plan


def _import_plan(path: str, model: nn.Module, sequence_parallel: bool) -> PlanMapping:
    """Import ``pkg.module.NAME``; a callable is called with no argument or ``(model, sequence_parallel)``."""
    module_path, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:
        raise ValueError(f"tp_plan={path!r}: cannot import module {module_path!r}: {exc!r}") from exc
    if not hasattr(module, attr):
        raise ValueError(f"tp_plan={path!r}: module {module_path!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if _is_factory(obj):
        try:
            required = [
                p
                for p in inspect.signature(obj).parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
            obj = obj() if not required else obj(model, sequence_parallel)
        except Exception as exc:
            raise ValueError(f"tp_plan={path!r}: calling it to get the plan failed: {exc!r}") from exc
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"tp_plan={path!r} must name a dict of FQN patterns to styles or a function returning one, "
            f"got {type(obj).__name__}"
        )
    check_plan_mapping(obj, what=f"tp_plan={path!r}")
    return obj


def _user_plan(hf_model: nn.Module, tp_plan: object, sequence_parallel: bool) -> tuple[PlanMapping, str]:
    if isinstance(tp_plan, Mapping):
        check_plan_mapping(tp_plan, what="tp_plan")
        return tp_plan, "the tp_plan dict"
    if isinstance(tp_plan, str):
        source = named_plan(tp_plan)
        if source is not None:
            plan = _call_factory(source, hf_model, sequence_parallel, f"named tp plan {tp_plan!r}")
            return plan, f"the named plan {tp_plan!r}"
        if "." in tp_plan.strip(".") and not tp_plan.endswith("."):
            return _import_plan(tp_plan, hf_model, sequence_parallel), f"the import path {tp_plan!r}"
        raise ValueError(
            f"tp_plan={tp_plan!r} is neither a registered plan name (registered: {named_plan_names()}) nor "
            "an import path 'pkg.module.NAME'; register it with register_named_tp_plan(name, plan)"
        )
    raise ValueError(
        f"tp_plan must be a dict, a registered plan name or an import path, got {type(tp_plan).__name__}"
    )


def _styles(plan: PlanMapping, prefix: str, what: str) -> dict[str, ParallelStyle]:
    return {join_fqn(prefix, k): to_parallel_style(v, where=f"{what}[{k!r}]") for k, v in plan.items()}


def _matching(model: nn.Module, plan: dict[str, ParallelStyle], source: str) -> dict[str, ParallelStyle]:
    """Drop (with a warning) the entries that match no module; raise if none matches."""
    unmatched = [key for key in plan if not match_modules(model, key)]
    if plan and len(unmatched) == len(plan):
        raise ValueError(
            f"{source} matches no module of {type(model).__name__}: none of {sorted(plan)} names a module. "
            "Plan keys are module paths relative to the transformers model (inside a peft wrapper), with "
            "'*' matching one name component, e.g. 'model.layers.*.self_attn.q_proj'."
        )
    if unmatched:
        warnings.warn(
            f"{source}: entries {unmatched} match no module of {type(model).__name__} and are skipped",
            stacklevel=4,
        )
    return {key: style for key, style in plan.items() if key not in unmatched}


def is_sequence_parallel_plan(plan: Mapping[str, ParallelStyle]) -> bool:
    """Whether a plan keeps activations sequence-sharded (it contains a `SequenceParallel` style)."""
    return any(isinstance(style, SequenceParallel) for style in plan.values())


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module.base_layer if is_lora_linear(module) else module, nn.Linear)


def _default_plan(hf_model: nn.Module, sequence_parallel: bool) -> tuple[dict[str, str] | None, str]:
    """The Llama-style decoder plan, if the model has exactly that layout (LoRA wrappers allowed).

    Under sequence parallelism its Megatron-style variant is used when the model has a final ``norm``
    and an LM head; otherwise sequence parallelism is derived from the TP plan.
    """
    base_prefix = getattr(hf_model, "base_model_prefix", "") or ""
    base = getattr(hf_model, base_prefix, None) if base_prefix else None
    if not isinstance(base, nn.Module):
        base_prefix, base = "", hf_model
    layers = match_modules(base, "layers.*")
    if not layers:
        return None, "the default Llama-style plan needs decoder blocks at `layers.<i>` of the base model"
    block_keys = [k.removeprefix("layers.*.") for k in DEFAULT_DECODER_PLAN if k.startswith("layers.*.")]
    linears = {k for k in block_keys if "." in k}  # the projections, not the modules whose input they take
    expected = linears | {"input_layernorm", "post_attention_layernorm"}
    for fqn, layer in layers:
        found = param_module_names(layer)
        if found != expected or not all(_is_linear(layer.get_submodule(k)) for k in linears):
            return None, (
                f"the default Llama-style plan does not fit decoder block {join_fqn(base_prefix, fqn)!r}: it "
                f"needs exactly the parameterised modules {sorted(expected)} (linear projections), found "
                f"{sorted(found)}"
            )
    outside = {n for n in param_module_names(base) if n.split(".")[0] != "layers"}
    if not isinstance(getattr(base, "embed_tokens", None), nn.Embedding) or not outside <= {
        "embed_tokens",
        "norm",
    }:
        return None, (
            "the default Llama-style plan needs `embed_tokens` (nn.Embedding) and at most a final `norm` "
            f"around the decoder blocks, found parameterised modules {sorted(outside)}"
        )
    head = module_fqn(hf_model, embedding_module(hf_model, "output"))
    has_head = head is not None and _is_linear(head[1])
    megatron = sequence_parallel and "norm" in outside and has_head
    template = DEFAULT_DECODER_SP_PLAN if megatron else DEFAULT_DECODER_PLAN
    plan = {join_fqn(base_prefix, k): v for k, v in template.items() if k != "lm_head"}
    if "norm" not in outside:
        plan = {k: v for k, v in plan.items() if k != join_fqn(base_prefix, "norm")}
    if head is not None and has_head:
        plan[head[0]] = template["lm_head"]
    return plan, "the default Llama-style decoder plan"


def _fit(
    model: nn.Module, plan: PlanMapping, prefix: str, tp_size: int, what: str
) -> tuple[dict[str, ParallelStyle], str | None]:
    """An automatically chosen plan as styles, with why it cannot shard ``model`` (None when it can)."""
    styles = _styles(plan, prefix, what)
    try:
        validate_tensor_parallel(model, tp_size, plan=expand_lora_plan(model, styles))
    except ValueError as exc:
        return styles, str(exc)
    return styles, None


def _with_sequence_blocks(
    model: nn.Module, plan: dict[str, ParallelStyle], source: str
) -> dict[str, ParallelStyle]:
    """``plan`` plus the entries that put the decoder blocks on the sequence-sharded stream.

    A plan with sequence-parallel norms is Megatron-style (its blocks take and give sequence slices);
    any other plan gets the derived form (each block gathers its input and cuts its output). See
    `automodel_distributed.tensor_parallel.sequence`.
    """
    from automodel_distributed.blocks import find_transformer_blocks

    try:
        blocks = [fqn for fqn, _ in find_transformer_blocks(model)]
    except ValueError as exc:
        raise ValueError(f"sequence parallelism needs the model's decoder blocks: {exc}") from None
    megatron = is_sequence_parallel_plan(plan)
    if not megatron:
        check_sequence_stream(model, blocks)
    last_cuts = stream_continues(model)  # a pipeline stage before the last
    entries = sequence_parallel_blocks(blocks, SequenceLength(), megatron=megatron, last_cuts=last_cuts)
    logger.info(
        "sequence parallelism from %s: %s over %d decoder blocks",
        source,
        "its sequence-parallel styles" if megatron else "derived (blocks gather their input)",
        len(blocks),
    )
    return {**plan, **entries}


def resolve_tp_plan(
    model: nn.Module,
    tp_plan: PlanMapping | str | None = None,
    *,
    sequence_parallel: bool = False,
    tp_size: int,
) -> dict[str, ParallelStyle]:
    """Choose the tensor-parallel plan of a model. Pure: no collective, nothing mutated.

    Sources, first match wins:

    1. ``tp_plan``: a dict (FQN pattern -> `ParallelStyle` or style name), a name registered with
       `register_named_tp_plan`, or an import path ``"pkg.module.NAME"`` to a dict or to a function
       returning one (called with no argument, or with ``(model, sequence_parallel)`` if it takes them).
    2. The registry (`register_tp_plan`, which starts with the built-in plans of
       `automodel_distributed.tensor_parallel.plans`): by class along the MRO, then by class name. A
       registration's sequence-parallel plan is used when ``sequence_parallel`` is asked for.
    3. The plan transformers declares (`translate_hf_tp_plan`), its attention and MLP modules taking
       their input as one DTensor where that is safe (`with_summed_block_inputs`).
    4. The default Llama-style decoder plan, if the model has exactly that layout; a warning says it was
       used.
    5. A plan derived from the model's structure (`automodel_distributed.tensor_parallel.derived`: every
       linear column-parallel with a gathered output); a warning says it was used.

    Sources 3-5 are skipped (the reason joins the error message) when they do not fit ``tp_size``
    (`validate_tensor_parallel`, e.g. key/value heads that do not divide); 1 and 2 are used as given.

    With ``sequence_parallel=True`` the chosen plan gets one entry per decoder block (found with
    `automodel_distributed.blocks.find_transformer_blocks`) that keeps the residual stream between the
    blocks sharded on the sequence: Megatron-style for a plan with sequence-parallel norms, derived (each
    block gathers its input) for any other plan. See `automodel_distributed.tensor_parallel.sequence`.

    Plan keys are relative to the transformers model; when ``model`` wraps it (peft's ``get_base_model()``)
    the returned keys carry the wrapper's prefix, so the result applies to ``model`` itself. The source
    used is logged.

    Args:
        model: The model (a transformers model, possibly inside a peft wrapper, or any module with a plan).
        tp_plan: The user's plan, or None to resolve one from the model.
        sequence_parallel: Ask for sequence parallelism.
        tp_size: The tensor-parallel degree; with no usable plan, ``tp_size > 1`` raises and ``1`` returns
            an empty plan.

    Returns:
        FQN pattern (relative to ``model``) -> a fresh `ParallelStyle`.

    Raises:
        ValueError: A bad ``tp_plan`` (unknown name, import failure naming the path, unknown style name,
            keys that match no module), no usable plan at ``tp_size > 1`` (the message lists the ways to
            provide one), or sequence parallelism for a model whose decoder blocks cannot be found.
    """
    tp_size = _check_tp_size(tp_size)
    styles, source = _resolve(model, tp_plan, sequence_parallel, tp_size)
    if sequence_parallel and styles:
        styles = _with_sequence_blocks(model, styles, source)
    return styles


_Found = tuple[dict[str, ParallelStyle], str]
"""A plan's styles by FQN, and where the plan came from."""


def _registered_plan(
    model: nn.Module,
    hf_model: nn.Module,
    prefix: str,
    sequence_parallel: bool,
    tp_size: int,
    notes: list[str],
) -> tuple[_Found | None, str]:
    """A plan registered for the model's class (or a base class), by class or by name."""
    class_name = type(hf_model).__qualname__
    registered = registered_plan_for(type(hf_model))
    if registered is None:
        return None, f"no plan is registered for {class_name} or its base classes (by class or by name)"
    how, source_plan, sp_plan = registered
    if _is_factory(source_plan):
        plan = _call_factory(source_plan, hf_model, sequence_parallel, f"tp plan of {class_name}")
    elif sequence_parallel and sp_plan is not None:
        plan = sp_plan
    else:
        assert isinstance(source_plan, Mapping)
        plan = source_plan
    logger.info("tensor-parallel plan of %s: the %s", class_name, how)
    return (_matching(model, _styles(plan, prefix, f"the {how}"), f"the {how}"), f"the {how}"), ""


def _transformers_plan(
    model: nn.Module,
    hf_model: nn.Module,
    prefix: str,
    sequence_parallel: bool,
    tp_size: int,
    notes: list[str],
) -> tuple[_Found | None, str]:
    """The model's own transformers plan (``base_model_tp_plan``), when it is exact and fits ``tp_size``.

    Completed with `plans.HF_TP_PLAN_SUPPLEMENTS` (entries transformers' plan lacks for the class).
    """
    hf_plan, note = translate_hf_tp_plan(hf_model)
    mro = type(hf_model).__mro__
    inexact = next((INEXACT_HF_TP_PLANS[c.__name__] for c in mro if c.__name__ in INEXACT_HF_TP_PLANS), None)
    if hf_plan is not None and inexact is not None:
        return None, f"transformers' tp plan is not exact for it: {inexact}"
    if hf_plan is None:
        return None, note
    supplement = next(
        (HF_TP_PLAN_SUPPLEMENTS[c.__name__] for c in mro if c.__name__ in HF_TP_PLAN_SUPPLEMENTS), {}
    )
    hf_plan = {**hf_plan, **{k: v for k, v in supplement.items() if match_modules(hf_model, k)}}
    styles, problem = _fit(model, hf_plan, prefix, tp_size, "transformers' tp plan")
    if problem is not None:
        return None, f"transformers' tp plan does not fit: {problem}"
    styles = with_summed_block_inputs(model, styles)
    logger.info("tensor-parallel plan of %s: transformers' plan (%s)", type(hf_model).__qualname__, note)
    return (styles, "transformers' tp plan"), ""


def _default_decoder_plan(
    model: nn.Module,
    hf_model: nn.Module,
    prefix: str,
    sequence_parallel: bool,
    tp_size: int,
    notes: list[str],
) -> tuple[_Found | None, str]:
    """The Llama-style decoder plan, with a warning naming why nothing more specific applied."""
    default, note = _default_plan(hf_model, sequence_parallel)
    if default is None:
        return None, note
    styles, problem = _fit(model, default, prefix, tp_size, "the default decoder plan")
    if problem is not None:
        return None, f"the default Llama-style plan does not fit: {problem}"
    class_name = type(hf_model).__qualname__
    warnings.warn(
        f"{class_name}: using the default Llama-style decoder tensor-parallel plan "
        f"({'; '.join(notes)}). Register a plan for this model to make the choice explicit.",
        stacklevel=4,
    )
    logger.warning("tensor-parallel plan of %s: the default Llama-style decoder plan", class_name)
    return (styles, "the default decoder plan"), ""


def _derived_plan(
    model: nn.Module,
    hf_model: nn.Module,
    prefix: str,
    sequence_parallel: bool,
    tp_size: int,
    notes: list[str],
) -> tuple[_Found | None, str]:
    """A plan derived from the model's structure (every linear column-parallel, outputs gathered)."""
    derived, note = derived_tp_plan(hf_model, tp_size)
    if derived is None or tp_size <= 1:
        return None, note
    styles, problem = _fit(model, derived, prefix, tp_size, "the derived plan")
    if problem is not None:
        return None, f"the plan derived from the model's structure does not fit: {problem}"
    class_name = type(hf_model).__qualname__
    warnings.warn(
        f"{class_name}: using a plan derived from the model's structure (every linear column-"
        f"parallel with gathered outputs; {'; '.join(notes)}). Register a plan for this model for "
        "a Megatron-style split of attention and MLP.",
        stacklevel=4,
    )
    logger.warning("tensor-parallel plan of %s: %s", class_name, note)
    return (styles, "the derived plan"), ""


_CANDIDATES = (_registered_plan, _transformers_plan, _default_decoder_plan, _derived_plan)
"""Where a plan comes from when the caller gives none, in order of preference."""


def _resolve(
    model: nn.Module, tp_plan: PlanMapping | str | None, sequence_parallel: bool, tp_size: int
) -> _Found:
    prefix, hf_model = find_hf_model(model)
    class_name = type(hf_model).__qualname__
    if tp_plan is not None:
        user_plan, source = _user_plan(hf_model, tp_plan, sequence_parallel)
        logger.info("tensor-parallel plan of %s: %s", class_name, source)
        return _matching(model, _styles(user_plan, prefix, source), source), source
    notes: list[str] = []
    for candidate in _CANDIDATES:
        found, note = candidate(model, hf_model, prefix, sequence_parallel, tp_size, notes)
        if found is not None:
            return found
        notes.append(note)
    if tp_size > 1:
        raise ValueError(
            f"no usable tensor-parallel plan for {class_name} at tp_size={tp_size}: "
            + "; ".join(notes)
            + ". "
            + _HOW_TO_REGISTER
        )
    logger.info("tensor-parallel plan of %s: none (tp_size=1)", class_name)
    return {}, "no plan"


def sharded_layer_kinds(model: nn.Module) -> dict[str, str]:
    """FQN -> ``"colwise"`` / ``"rowwise"`` for every module the model's TP plan shards (reads only).

    What a planner needs to tell sharded activations (between a column- and a row-parallel layer) from
    replicated ones. A model without a plan gets ``{}``.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    try:  # any degree above 1 gives the plan's styles
        plan = resolve_tp_plan(model, tp_size=2)
    except ValueError:
        return {}
    styles: dict[str, str] = {}
    for key, style in plan.items():
        kind = "colwise" if isinstance(style, ColwiseParallel) else None
        kind = "rowwise" if isinstance(style, RowwiseParallel) else kind
        if kind is not None:
            styles.update((fqn, kind) for fqn, _module in match_modules(model, key))
    return styles
