"""`translate_hf_tp_plan`, `get_hf_tp_shard_plan`: the TP plan transformers declares, in our styles.

transformers 5 declares a plan per model (``base_model_tp_plan`` on the config, ``_tp_plan`` on the
class, merged into the instance's ``_tp_plan``) in its own style names. How each name is translated:

- ``colwise``, ``rowwise``, ``colwise_gather_output``, ``rowwise_split_input``, ``embedding_rowwise``,
  ``embedding_colwise``, ``replicated_with_grad_allreduce``, ``sequence_parallel``: the style of the same
  meaning (`automodel_distributed.tensor_parallel.styles`).
- ``mla_kv_a_proj``: `MlaKvAprojParallel` with the config's ``qk_rope_head_dim``.
- Expert and runtime-local styles (``moe_*``, ``packed_*``, ``local_params``, ``all_reduce``, ``ep_*``,
  ``grouped_*``, ``gather``, ``replicate``): the module is left out of the plan together with every
  entry under it, so it stays replicated. That is exact because its input is replicated; it only forgoes
  sharding the module's memory.

The input embedding becomes vocab-parallel (``rowwise_rep``) when it is a plain embedding (it holds its
``weight`` only, so the all-reduce of the partial lookups comes after everything it computes) and the
plan does not say otherwise; the output embedding (``lm_head``) becomes column-parallel with
vocab-sharded DTensor logits (``colwise_vocab``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from automodel_distributed.tensor_parallel._fqn import match_modules
from automodel_distributed.tensor_parallel.linear_styles import MlaKvAprojParallel
from automodel_distributed.tensor_parallel.styles import (
    HF_STYLE_ALIASES,
    STYLE_NAMES,
    hf_style_is_skipped,
    parallel_style,
)
from automodel_modules import embedding_module, join_fqn

__all__ = [
    "get_hf_tp_shard_plan",
    "is_plain_embedding",
    "module_fqn",
    "raw_hf_tp_plan",
    "translate_hf_tp_plan",
]


def module_fqn(root: nn.Module, module: object) -> tuple[str, nn.Module] | None:
    """``(fqn, module)`` of ``module`` inside ``root``, or None."""
    if not isinstance(module, nn.Module):
        return None
    for name, sub in root.named_modules():
        if sub is module:
            return name, sub
    return None


def raw_hf_tp_plan(hf_model: nn.Module) -> dict[str, Any]:
    """Transformers' plan with keys relative to ``hf_model``, in transformers' style names.

    The instance plan ``model._tp_plan`` (transformers 5 merges the class plan, the config's
    ``base_model_tp_plan`` under the base-model prefix and a vocab-parallel ``embed_tokens`` into it), or,
    when that is empty, the class ``_tp_plan`` plus ``config.base_model_tp_plan`` under
    ``base_model_prefix``.
    """
    raw: Mapping[str, Any] | None = getattr(hf_model, "_tp_plan", None)
    if isinstance(raw, Mapping) and raw:
        return dict(raw)
    merged: dict[str, Any] = dict(getattr(type(hf_model), "_tp_plan", None) or {})
    base_plan = getattr(getattr(hf_model, "config", None), "base_model_tp_plan", None) or {}
    base_prefix = getattr(hf_model, "base_model_prefix", "") or ""
    if not base_prefix or not isinstance(getattr(hf_model, base_prefix, None), nn.Module):
        base_prefix = ""
    merged.update({join_fqn(base_prefix, k): v for k, v in dict(base_plan).items()})
    return merged


def _rope_dim(hf_model: nn.Module) -> int | None:
    config = getattr(hf_model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    value = getattr(text, "qk_rope_head_dim", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def is_plain_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` whose only parameter is its own ``weight`` (no child computes after the lookup)."""
    return isinstance(module, nn.Embedding) and [n for n, _ in module.named_parameters()] == ["weight"]


def _names_a_parameter(hf_model: nn.Module, key: str) -> bool:
    owner_key, _, leaf = key.rpartition(".")
    return any(
        leaf in dict(owner.named_parameters(recurse=False)) for _, owner in match_modules(hf_model, owner_key)
    )


def translate_hf_tp_plan(
    hf_model: nn.Module,
) -> tuple[dict[str, str | ParallelStyle] | None, str]:
    """Translate the tensor-parallel plan transformers declares for a model (see the module docstring).

    Returns:
        ``(plan, note)``: the plan with keys relative to ``hf_model`` (None when unusable) and a note saying
        what was left out or why the plan is unusable. Entries that match no module are dropped; an entry
        that names a bare parameter outside the left-out modules makes the plan unusable (it would be
        sharded by nothing while its siblings are).
    """
    raw = raw_hf_tp_plan(hf_model)
    if not raw:
        return (
            None,
            "transformers declares no tp plan for it (_tp_plan / config.base_model_tp_plan are empty)",
        )
    plan: dict[str, str | ParallelStyle] = {}
    skipped: list[str] = []
    unsupported: list[str] = []
    for key, style in raw.items():
        name = HF_STYLE_ALIASES.get(style, style) if isinstance(style, str) else style
        if isinstance(name, str) and hf_style_is_skipped(name):
            skipped.append(key)
        elif name == "mla_kv_a_proj" and _rope_dim(hf_model) is not None:
            rope_dim = _rope_dim(hf_model)
            assert rope_dim is not None
            plan[key] = MlaKvAprojParallel(rope_dim)
        elif isinstance(name, str) and name in STYLE_NAMES:
            plan[key] = name
        else:
            unsupported.append(f"{key}: {style!r}")
    if unsupported:
        return None, f"transformers' tp plan uses styles that have no equivalent here: {unsupported}"
    plan = {k: v for k, v in plan.items() if not any(k == s or k.startswith(s + ".") for s in skipped)}
    bare = [k for k in plan if not match_modules(hf_model, k) and _names_a_parameter(hf_model, k)]
    if bare:
        return None, f"transformers' tp plan shards bare parameters that no style here can shard: {bare}"
    embeddings = module_fqn(hf_model, embedding_module(hf_model, "input"))
    if embeddings is not None and embeddings[0] not in skipped:
        if is_plain_embedding(embeddings[1]):
            plan = {embeddings[0]: "rowwise_rep", **{k: v for k, v in plan.items() if k != embeddings[0]}}
        else:
            plan.pop(embeddings[0], None)
    head = module_fqn(hf_model, embedding_module(hf_model, "output"))
    if head is not None and isinstance(head[1], nn.Linear):
        plan[head[0]] = "colwise_vocab"
    plan = {k: v for k, v in plan.items() if match_modules(hf_model, k)}
    ends = {found[0] for found in (embeddings, head) if found is not None}
    if not any(
        isinstance(v, str) and v.startswith(("colwise", "rowwise")) for k, v in plan.items() if k not in ends
    ):
        return None, "transformers' tp plan shards no module of this model besides its embeddings"
    note = f"left out (stay replicated): {skipped}" if skipped else "nothing left out"
    return plan, note


def get_hf_tp_shard_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The model's own (transformers) tensor-parallel plan as ``{module path: ParallelStyle}``.

    The reference system's name for `translate_hf_tp_plan` followed by `parallel_style`: the same
    translation `resolve_tp_plan` uses for transformers' plan (expert and "local" styles left replicated,
    the input embedding vocab-parallel, the output head column-parallel with vocab-sharded logits). Pure:
    the model is not changed.

    Raises:
        ValueError: transformers declares no usable plan for the model (the message says why); give
            ``FSDP2Config.tp_plan`` or run with ``tp_size=1``.
    """
    plan, note = translate_hf_tp_plan(model)
    if plan is None:
        raise ValueError(
            f"Hugging Face TP plan is not supported for {type(model).__name__}: {note}; provide "
            "FSDP2Config.tp_plan or run with tp_size=1"
        )
    return {fqn: s if isinstance(s, ParallelStyle) else parallel_style(s) for fqn, s in plan.items()}
