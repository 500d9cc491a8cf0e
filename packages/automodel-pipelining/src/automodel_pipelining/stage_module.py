"""Build one pipeline stage's module from the full model, and give it a stage forward.

A stage module is the full model's module tree pruned to the FQNs the stage owns: the modules on the
path to an owned module are *shell copies* (new module objects with their own child and hook tables,
sharing no parameters), owned modules are the full model's own objects (moved, not copied), parameter-
free shared modules (rotary embeddings) are deep-copied per stage, and everything else is ``None``.
The layer container becomes an ``nn.ModuleDict`` keyed by the original layer index, so parameter names
stay those of the full model (``model.layers.5.mlp.up_proj.weight``) and checkpoints load into stages.

Because owned modules are moved rather than copied, building the stages costs no parameter memory, and
the full model must not be used afterwards (its blocks belong to the stages).
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel_mesh.modules import is_dtensor
from automodel_pipelining.layout import DecoderLayout

__all__ = [
    "ATTENTION_MASK_FUNCTIONS",
    "ROTARY_EMBEDDING_NAMES",
    "StageForwardSpec",
    "build_stage_module",
    "layer_attention_type",
]

ATTENTION_MASK_FUNCTIONS: dict[str, str] = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}
"""Layer attention type (``config.layer_types``) -> mask builder in ``transformers.masking_utils``."""

ROTARY_EMBEDDING_NAMES: tuple[str, ...] = ("rotary_emb",)
"""Names of shared modules that compute rotary position embeddings: called as ``m(hidden, position_ids)``
on every stage, their output handed to every layer as ``position_embeddings``."""

_SPEC_ATTR = "_automodel_pp_spec"  # where a patched module keeps its StageForwardSpec

# Keyword arguments that transformers' own forwards pass down and that a stage can ignore when unset.
_IGNORABLE_KWARGS = frozenset(
    {"cache", "past_key_values", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
     "cache_position", "labels", "logits_to_keep"}
)  # fmt: skip


@dataclass(frozen=True)
class StageForwardSpec:
    """Where the stage forward finds its parts (attribute paths relative to the module it patches)."""

    embed: str | None
    layers: str
    norm: str | None
    shared: tuple[str, ...]
    base: str
    head: str | None
    stage_index: int
    num_stages: int


# ----------------------------------------------------------------------------------------- pruning


def _shell_copy(module: nn.Module) -> nn.Module:
    """A new module object with the same attributes but its own child, parameter, buffer and hook tables."""
    shell = copy.copy(module)
    for key, value in list(vars(shell).items()):
        if isinstance(value, dict | set | list):
            shell.__dict__[key] = copy.copy(value)
    return shell


def _prefix_of(fqn: str, other: str) -> bool:
    return other == fqn or other.startswith(fqn + ".") if fqn else True


def _prune(
    module: nn.Module, fqn: str, keep: set[str], layers_fqn: str, copy_whole: set[str]
) -> nn.Module | None:
    if fqn in keep:
        return copy.deepcopy(module) if fqn in copy_whole else module
    if not any(_prefix_of(fqn, k) for k in keep):
        return None
    if fqn == layers_fqn:
        kept = {name: child for name, child in module.named_children() if f"{fqn}.{name}" in keep}
        return nn.ModuleDict(kept)
    direct = [name for name, p in module._parameters.items() if p is not None]
    if direct:
        raise ValueError(
            f"module {fqn or '<root>'!r} ({type(module).__name__}) owns parameters {direct} directly "
            "but only part of it goes to this stage; list it whole in one stage of "
            "module_fqns_per_model_part"
        )
    shell = _shell_copy(module)
    for name, child in list(module._modules.items()):
        child_fqn = f"{fqn}.{name}" if fqn else name
        shell._modules[name] = (
            None if child is None else _prune(child, child_fqn, keep, layers_fqn, copy_whole)
        )
    return shell


# ----------------------------------------------------------------------------------------- forward


def _child(module: nn.Module, path: str | None) -> nn.Module | None:
    if not path:
        return module if path == "" else None
    current: nn.Module | None = module
    for part in path.split("."):
        current = getattr(current, part, None) if current is not None else None
    return current if isinstance(current, nn.Module) else None


def layer_attention_type(config: Any, layer_index: int) -> str:
    """Return the attention type of layer ``layer_index``.

    ``config.layer_types[i]`` when the config lists them, else ``sliding_attention`` when it has a
    ``sliding_window``, else ``full_attention``.
    """
    layer_types = getattr(config, "layer_types", None)
    if (
        isinstance(layer_types, Sequence)
        and not isinstance(layer_types, str)
        and layer_index < len(layer_types)
    ):
        return str(layer_types[layer_index])
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


@functools.cache
def _mask_builder(kind: str) -> Callable[..., Any]:
    name = ATTENTION_MASK_FUNCTIONS.get(kind)
    if name is None:
        raise ValueError(
            f"no causal-mask builder for attention type {kind!r}; known: {sorted(ATTENTION_MASK_FUNCTIONS)} "
            "(extend automodel_pipelining.stage_module.ATTENTION_MASK_FUNCTIONS)"
        )
    import transformers.masking_utils as masking_utils

    fn: Callable[..., Any] = getattr(masking_utils, name)
    params = set(inspect.signature(fn).parameters)

    def build(config: Any, embeds: torch.Tensor, attention_mask: Any, position_ids: torch.Tensor) -> Any:
        kwargs: dict[str, Any] = {
            "config": config,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
        for cache_name in ("cache", "past_key_values"):
            if cache_name in params:
                kwargs[cache_name] = None
        if "cache_position" in params:
            kwargs["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
        return fn(**kwargs)

    return build


def _first(output: Any) -> torch.Tensor:
    """The tensor of a module output: ``logits`` / ``last_hidden_state`` of a model output, or element 0."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = output.get(key) if isinstance(output, dict) else getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find the output tensor of a pipeline stage in a {type(output).__name__}")


def _to_local_full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor output (e.g. vocab-sharded logits under TP) becomes a full plain tensor (differentiable)."""
    return t.full_tensor() if is_dtensor(t) else t


def _check_kwargs(spec: StageForwardSpec, kwargs: dict[str, Any]) -> None:
    unknown = sorted(
        k for k, v in kwargs.items() if k not in _IGNORABLE_KWARGS or (v is not None and v is not False)
    )
    if unknown:
        raise TypeError(
            f"pipeline stage {spec.stage_index} takes position_ids and attention_mask as keyword inputs; "
            f"got unsupported {unknown}"
        )


def _inner_forward(
    self: nn.Module,
    inputs: torch.Tensor | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Stage forward of the base model: token ids (first stage) or hidden states in, hidden states out."""
    spec: StageForwardSpec = getattr(self, _SPEC_ATTR)
    _check_kwargs(spec, kwargs)
    x = inputs if inputs is not None else input_ids if input_ids is not None else inputs_embeds
    if x is None:
        raise ValueError(f"pipeline stage {spec.stage_index} got no input tensor")
    embed = _child(self, spec.embed)
    if embed is not None and not x.is_floating_point():
        hidden = embed(x)
    elif x.is_floating_point():
        hidden = x
    else:
        raise ValueError(
            f"pipeline stage {spec.stage_index} of {spec.num_stages} has no input embedding but got integer "
            f"inputs of shape {tuple(x.shape)}; only the first stage takes token ids"
        )
    batch, seq = hidden.shape[0], hidden.shape[1]
    if position_ids is None:
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0).expand(batch, -1)
    position_embeddings = None
    for name in spec.shared:
        rotary = _child(self, name) if name.rpartition(".")[2] in ROTARY_EMBEDDING_NAMES else None
        if rotary is not None:
            position_embeddings = rotary(hidden, position_ids)
    config = getattr(self, "config", None)
    layers = _child(self, spec.layers)
    masks: dict[str, Any] = {}
    for layer_name, layer in layers.named_children() if layers is not None else ():
        kind = layer_attention_type(config, int(layer_name)) if layer_name.isdigit() else "full_attention"
        if kind not in masks:
            masks[kind] = _mask_builder(kind)(config, hidden, attention_mask, position_ids)
        out = layer(
            hidden,
            attention_mask=masks[kind],
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
        hidden = out[0] if isinstance(out, tuple) else out
    norm = _child(self, spec.norm)
    if norm is not None:
        hidden = norm(hidden)
    return hidden


def _outer_forward(
    self: nn.Module,
    inputs: torch.Tensor | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Stage forward of the causal-LM wrapper: base model, then the LM head on the last stage."""
    spec: StageForwardSpec = getattr(self, _SPEC_ATTR)
    _check_kwargs(spec, kwargs)
    x = inputs if inputs is not None else input_ids if input_ids is not None else inputs_embeds
    base = _child(self, spec.base)
    if base is None:
        raise ValueError(f"pipeline stage {spec.stage_index} has no base model at {spec.base!r}")
    hidden = _first(base(x, position_ids=position_ids, attention_mask=attention_mask))
    head = _child(self, spec.head)
    if head is not None:
        hidden = head(hidden)
    return _to_local_full(hidden)


def _output_to_tensor_hook(_module: nn.Module, _args: Any, output: Any) -> torch.Tensor:
    return _to_local_full(_first(output))


def build_stage_module(
    model: nn.Module,
    layout: DecoderLayout,
    fqns: Sequence[str],
    *,
    stage_index: int,
    num_stages: int,
    patch_inner_model: bool = True,
    patch_causal_lm_model: bool = True,
) -> nn.Module:
    """Prune ``model`` to the modules ``fqns`` and install the stage forward.

    The returned module has the full model's class and module paths; modules it does not own are
    ``None`` and the layer container is an ``nn.ModuleDict`` keyed by the original layer names. Its
    forward (with both patches) takes one tensor (token ids on the first stage, hidden states elsewhere)
    plus optional ``position_ids`` and ``attention_mask`` keyword arguments, and returns one tensor
    (logits on the last stage, hidden states elsewhere; a DTensor output is gathered to a full tensor).
    Rotary position embeddings and causal masks are computed on every stage.

    Preconditions: ``fqns`` was validated against ``layout`` (see `automodel_pipelining.split`). The model
    may be on the meta device. ``model``'s own modules are shared with (moved to) the stage; ``model``
    itself is not modified.

    Returns:
        The stage module.
    """
    keep = set(fqns)
    copy_whole = {fqn for fqn in fqns if next(model.get_submodule(fqn).parameters(), None) is None}
    stage = _prune(model, "", keep, layout.layers, copy_whole)
    if stage is None:  # pragma: no cover - the root is an ancestor of every FQN
        raise ValueError(f"stage {stage_index} owns no modules")
    base_module = _child(stage, layout.base)
    if base_module is None:
        raise ValueError(f"the base model {layout.base!r} is missing from stage {stage_index}")
    spec = StageForwardSpec(
        embed=layout.relative(layout.embed),
        layers=layout.relative(layout.layers) or "",
        norm=layout.relative(layout.norm),
        shared=tuple(r for r in (layout.relative(f) for f in layout.shared) if r),
        base=layout.base,
        head=layout.head,
        stage_index=stage_index,
        num_stages=num_stages,
    )
    setattr(base_module, _SPEC_ATTR, spec)
    setattr(stage, _SPEC_ATTR, spec)
    if patch_inner_model:
        base_module.forward = types.MethodType(_inner_forward, base_module)
    if stage is not base_module and patch_causal_lm_model:
        stage.forward = types.MethodType(_outer_forward, stage)
    else:
        stage.register_forward_hook(_output_to_tensor_hook)
    return stage
