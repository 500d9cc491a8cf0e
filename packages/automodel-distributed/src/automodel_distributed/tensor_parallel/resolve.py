"""`resolve_tp_plan`: choose a model's tensor-parallel plan, without side effects or collectives."""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from automodel_distributed.tensor_parallel._fqn import match_modules
from automodel_distributed.tensor_parallel.plans import DEFAULT_DECODER_PLAN, DEFAULT_DECODER_SP_PLAN
from automodel_distributed.tensor_parallel.registry import (
    PlanMapping,
    PlanSource,
    check_plan_mapping,
    named_plan,
    named_plan_names,
    registered_plan_for,
)
from automodel_distributed.tensor_parallel.styles import (
    HF_STYLE_ALIASES,
    STYLE_NAMES,
    hf_style_is_skipped,
    to_parallel_style,
)
from automodel_mesh.modules import find_hf_model, join_fqn

__all__ = ["is_sequence_parallel_plan", "resolve_tp_plan", "translate_hf_tp_plan"]

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


def translate_hf_tp_plan(hf_model: nn.Module) -> tuple[dict[str, str] | None, str]:
    """Translate the tensor-parallel plan transformers declares for a model into our style names.

    Reads the instance plan ``model._tp_plan`` (transformers 5 merges the class plan, the config's
    ``base_model_tp_plan`` under the base-model prefix and a vocab-parallel ``embed_tokens`` into it), or,
    when that is empty, the class ``_tp_plan`` plus ``config.base_model_tp_plan`` prefixed with
    ``base_model_prefix``. Expert, expert-parallel, "local", "gather" and "replicate" styles are left
    out, together with the entries under the modules they cover (those modules stay replicated, which is
    correct since their input is replicated). The input embedding becomes vocab-parallel (``rowwise_rep``)
    and the output embedding (``lm_head``) column-parallel with vocab-sharded DTensor logits
    (``colwise_vocab``). Entries that match no module are dropped.

    Returns:
        ``(plan, note)``: the plan with keys relative to ``hf_model`` (None when unusable) and a note saying
        what was skipped or why the plan is unusable.
    """
    raw: Mapping[str, Any] | None = getattr(hf_model, "_tp_plan", None)
    if not isinstance(raw, Mapping) or not raw:
        merged: dict[str, Any] = dict(getattr(type(hf_model), "_tp_plan", None) or {})
        base_plan = getattr(getattr(hf_model, "config", None), "base_model_tp_plan", None) or {}
        base_prefix = getattr(hf_model, "base_model_prefix", "") or ""
        if not base_prefix or not isinstance(getattr(hf_model, base_prefix, None), nn.Module):
            base_prefix = ""
        merged.update({join_fqn(base_prefix, k): v for k, v in dict(base_plan).items()})
        raw = merged
    if not raw:
        return (
            None,
            "transformers declares no tp plan for it (_tp_plan / config.base_model_tp_plan are empty)",
        )
    plan: dict[str, str] = {}
    skipped: list[str] = []
    unsupported: list[str] = []
    for key, style in raw.items():
        if isinstance(style, str) and hf_style_is_skipped(style):
            skipped.append(key)
        elif isinstance(style, str) and HF_STYLE_ALIASES.get(style, style) in STYLE_NAMES:
            plan[key] = HF_STYLE_ALIASES.get(style, style)
        else:
            unsupported.append(f"{key}: {style!r}")
    if unsupported:
        return None, f"transformers' tp plan uses styles that have no equivalent here: {unsupported}"
    plan = {k: v for k, v in plan.items() if not any(k.startswith(s + ".") for s in skipped)}
    embeddings = _module_fqn(hf_model, _call_or_none(hf_model, "get_input_embeddings"))
    if embeddings is not None and isinstance(embeddings[1], nn.Embedding):
        plan = {embeddings[0]: "rowwise_rep", **{k: v for k, v in plan.items() if k != embeddings[0]}}
    head = _module_fqn(hf_model, _call_or_none(hf_model, "get_output_embeddings"))
    if head is not None and isinstance(head[1], nn.Linear):
        plan[head[0]] = "colwise_vocab"
    plan = {k: v for k, v in plan.items() if match_modules(hf_model, k)}
    if not any(v.startswith(("colwise", "rowwise")) for v in plan.values()):
        return None, "transformers' tp plan shards no module of this model"
    note = f"left out (stay replicated): {skipped}" if skipped else "nothing left out"
    return plan, note


def _call_or_none(model: nn.Module, method: str) -> Any:
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError):
        return None


def _module_fqn(root: nn.Module, module: object) -> tuple[str, nn.Module] | None:
    if not isinstance(module, nn.Module):
        return None
    for name, sub in root.named_modules():
        if sub is module:
            return name, sub
    return None


def _param_modules(module: nn.Module) -> set[str]:
    return {
        name for name, sub in module.named_modules() if next(sub.parameters(recurse=False), None) is not None
    }


def _default_plan(hf_model: nn.Module, sequence_parallel: bool) -> tuple[dict[str, str] | None, str]:
    """The Llama-style decoder plan, if the model has exactly that layout."""
    base_prefix = getattr(hf_model, "base_model_prefix", "") or ""
    base = getattr(hf_model, base_prefix, None) if base_prefix else None
    if not isinstance(base, nn.Module):
        base_prefix, base = "", hf_model
    template = DEFAULT_DECODER_SP_PLAN if sequence_parallel else DEFAULT_DECODER_PLAN
    layers = match_modules(base, "layers.*")
    if not layers:
        return None, "the default Llama-style plan needs decoder blocks at `layers.<i>` of the base model"
    block_keys = [k.removeprefix("layers.*.") for k in template if k.startswith("layers.*.")]
    linears = {k for k in block_keys if template[f"layers.*.{k}"].startswith(("colwise", "rowwise"))}
    expected = linears | {"input_layernorm", "post_attention_layernorm"}
    for fqn, layer in layers:
        found = _param_modules(layer)
        if found != expected or not all(isinstance(layer.get_submodule(k), nn.Linear) for k in linears):
            return None, (
                f"the default Llama-style plan does not fit decoder block {join_fqn(base_prefix, fqn)!r}: it "
                f"needs exactly the parameterised modules {sorted(expected)} (linear projections), found "
                f"{sorted(found)}"
            )
    outside = {n for n in _param_modules(base) if n.split(".")[0] != "layers"}
    if not isinstance(getattr(base, "embed_tokens", None), nn.Embedding) or not outside <= {
        "embed_tokens",
        "norm",
    }:
        return None, (
            "the default Llama-style plan needs `embed_tokens` (nn.Embedding) and at most a final `norm` "
            f"around the decoder blocks, found parameterised modules {sorted(outside)}"
        )
    plan = {join_fqn(base_prefix, k): v for k, v in template.items() if k != "lm_head"}
    if sequence_parallel and "norm" not in outside:
        return None, "the default sequence-parallel plan needs a final `norm`"
    if "norm" not in outside:
        plan = {k: v for k, v in plan.items() if k != join_fqn(base_prefix, "norm")}
    head = _module_fqn(hf_model, _call_or_none(hf_model, "get_output_embeddings"))
    if head is not None and isinstance(head[1], nn.Linear):
        plan[head[0]] = template["lm_head"]
    elif sequence_parallel:
        return None, "the default sequence-parallel plan needs an LM head to gather the sequence"
    return plan, "the default Llama-style decoder plan"


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
       The plan is used as given; with ``sequence_parallel=True`` and no sequence-parallel style in it, a
       warning says so.
    2. The registry (`register_tp_plan`, which starts with the built-in plans for Llama, Qwen2, Qwen3,
       Mistral, Gemma, Gemma2, Gemma3 and Phi-3 causal LMs): by class along the MRO, then by class name.
    3. The plan transformers declares (`translate_hf_tp_plan`); it has no sequence-parallel variant, so it is
       skipped when ``sequence_parallel`` is asked for.
    4. The default Llama-style decoder plan, if the model has exactly that layout; a warning says it was
       used.

    Plan keys are relative to the transformers model; when ``model`` wraps it (peft's ``get_base_model()``)
    the returned keys carry the wrapper's prefix, so the result applies to ``model`` itself. The source
    used is logged.

    Args:
        model: The model (a transformers model, possibly inside a peft wrapper, or any module with a plan).
        tp_plan: The user's plan, or None to resolve one from the model.
        sequence_parallel: Ask for the sequence-parallel variant.
        tp_size: The tensor-parallel degree; with no usable plan, ``tp_size > 1`` raises and ``1`` returns
            an empty plan.

    Returns:
        FQN pattern (relative to ``model``) -> a fresh `ParallelStyle`.

    Raises:
        ValueError: A bad ``tp_plan`` (unknown name, import failure naming the path, unknown style name,
            keys that match no module), a registration without the requested sequence-parallel variant,
            or no usable plan at ``tp_size > 1`` (the message lists the ways to provide one).
    """
    tp_size = _check_tp_size(tp_size)
    prefix, hf_model = find_hf_model(model)
    class_name = type(hf_model).__qualname__
    if tp_plan is not None:
        user_plan, source = _user_plan(hf_model, tp_plan, sequence_parallel)
        styles = _matching(model, _styles(user_plan, prefix, source), source)
        if sequence_parallel and not is_sequence_parallel_plan(styles):
            warnings.warn(
                f"sequence_parallel=True but {source} has no sequence-parallel style; it is used as given, "
                "so activations are not sequence-sharded",
                stacklevel=2,
            )
        logger.info("tensor-parallel plan of %s: %s", class_name, source)
        return styles

    notes: list[str] = []
    registered = registered_plan_for(type(hf_model))
    if registered is not None:
        how, source_plan, sp_plan = registered
        if _is_factory(source_plan):
            plan = _call_factory(source_plan, hf_model, sequence_parallel, f"tp plan of {class_name}")
        elif sequence_parallel:
            if sp_plan is None:
                raise ValueError(
                    f"sequence_parallel=True but the {how} has no sequence-parallel variant; register one "
                    "with register_tp_plan(..., sequence_parallel_plan={...}, overwrite=True) or pass tp_plan"
                )
            plan = sp_plan
        else:
            assert isinstance(source_plan, Mapping)
            plan = source_plan
        styles = _matching(model, _styles(plan, prefix, f"the {how}"), f"the {how}")
        logger.info("tensor-parallel plan of %s: the %s", class_name, how)
        return styles
    notes.append(f"no plan is registered for {class_name} or its base classes (by class or by name)")

    if sequence_parallel:
        notes.append("transformers' tp plan was not tried: it has no sequence-parallel variant")
    else:
        hf_plan, note = translate_hf_tp_plan(hf_model)
        if hf_plan is not None:
            logger.info("tensor-parallel plan of %s: transformers' plan (%s)", class_name, note)
            return _styles(hf_plan, prefix, "transformers' tp plan")
        notes.append(note)

    default, note = _default_plan(hf_model, sequence_parallel)
    if default is not None:
        warnings.warn(
            f"{class_name}: using the default Llama-style decoder tensor-parallel plan "
            f"({'; '.join(notes)}). Register a plan for this model to make the choice explicit.",
            stacklevel=2,
        )
        logger.warning("tensor-parallel plan of %s: the default Llama-style decoder plan", class_name)
        return _styles(default, prefix, "the default decoder plan")
    notes.append(note)
    if tp_size > 1:
        raise ValueError(
            f"no usable tensor-parallel plan for {class_name} at tp_size={tp_size}: "
            + "; ".join(notes)
            + ". "
            + _HOW_TO_REGISTER
        )
    logger.info("tensor-parallel plan of %s: none (tp_size=1)", class_name)
    return {}
