"""Where the parts of a decoder model live: embeddings, layers, final norm, LM head, shared modules.

The layout is read from what transformers declares: the model's ``_pp_plan`` (full FQNs, e.g.
``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``) or its config's
``base_model_pp_plan`` (relative to ``base_model_prefix``), then ``get_output_embeddings()`` for the LM
head. Models that declare neither fall back to the conventional names in `FALLBACK_NAMES`. Other modules
with parameters beside the layers (learned position embeddings, input and output projections) go to the
stage that runs them: the order is read from one forward of the base model on fake tensors
(`automodel_pipelining.probe`), which also tells whether stages can compute exactly what the model
computes (`DecoderLayout.problems`). No model family is named here. Nothing is mutated
(meta-device models work).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from automodel_modules import embedding_module, find_hf_model, fqn_of, join_fqn
from automodel_pipelining.probe import LAYERS_MARK, ForwardProbe, probe_forward

__all__ = [
    "FALLBACK_HEAD_NAMES",
    "FALLBACK_NAMES",
    "DecoderLayout",
    "resolve_decoder_layout",
]

logger = logging.getLogger(__name__)

FALLBACK_NAMES: Mapping[str, tuple[str, ...]] = {
    "embed": ("embed_tokens", "wte", "word_embeddings", "embeddings"),
    "layers": ("layers", "h", "blocks"),
    "norm": ("norm", "ln_f", "final_layernorm", "final_layer_norm"),
}
"""Attribute names (children of the base model) tried when a model declares no pipeline plan."""

FALLBACK_HEAD_NAMES: tuple[str, ...] = ("lm_head", "output", "embed_out")
"""Attribute names of the LM head (children of the model) tried when ``get_output_embeddings`` finds none."""


@dataclass(frozen=True)
class DecoderLayout:
    """FQNs (in the full model) of the parts of a decoder that a pipeline split distributes."""

    base: str
    """The base (inner) model, e.g. ``model``; ``""`` when the model is the base model itself."""
    layers: str
    """The container of the decoder layers, e.g. ``model.layers``."""
    layer_names: tuple[str, ...]
    """Child names of the container in forward order (``"0"``, ``"1"``, ...)."""
    embed: str | None
    """The input embedding (first stage)."""
    norm: str | None
    """The final norm (last stage)."""
    head: str | None
    """The LM head (last stage); ``None`` for a bare base model."""
    first_extras: tuple[str, ...] = ()
    """Other modules with parameters the model runs before its layers (learned position embeddings, an
    input projection); placed on the first stage."""
    last_extras: tuple[str, ...] = ()
    """Other modules with parameters the model runs after its layers (an output projection); placed on
    the last stage."""
    unplaced: tuple[str, ...] = ()
    """Other modules with parameters whose stage is unknown (the model's forward does not run on fake
    tensors); an automatic split refuses the model, an explicit one places them."""
    unplaced_reason: str = ""
    """Why their stage is unknown."""
    problems: tuple[str, ...] = ()
    """What keeps a stage from computing exactly what the model computes (the probe of
    `automodel_pipelining.probe`); a pipeline refuses a model that has any."""
    shared: tuple[str, ...] = ()
    """Parameter-free modules every stage needs (rotary embeddings); each stage gets its own copy."""
    embed_given_embeds: bool = False
    """Whether the forward calls the input embedding when given ``inputs_embeds``: later stages then get a
    stand-in that hands them on (what it computes from them is discarded there)."""
    layer_output_arity: tuple[int, ...] | None = None
    """Per layer: ``0`` when it returns a tensor, else the length of the tuple it returns, as one forward
    on fake tensors showed (`ForwardProbe.output_arity`); ``None`` when the real layers could not run
    there. A later stage's stand-ins for earlier layers return the same structure."""

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layer_names)

    @property
    def layer_fqns(self) -> tuple[str, ...]:
        """FQN of every layer, in forward order."""
        return tuple(join_fqn(self.layers, name) for name in self.layer_names)

    @property
    def first_stage_fqns(self) -> tuple[str, ...]:
        """Modules that go to the first stage besides its layers."""
        return tuple(f for f in (self.embed, *self.first_extras) if f is not None)

    @property
    def last_stage_fqns(self) -> tuple[str, ...]:
        """Modules that go to the last stage besides its layers."""
        return tuple(f for f in (self.norm, *self.last_extras, self.head) if f is not None)

    def relative(self, fqn: str | None) -> str | None:
        """``fqn`` relative to the base model (``None`` stays ``None``)."""
        if fqn is None:
            return None
        if not self.base:
            return fqn
        if not fqn.startswith(self.base + "."):
            raise ValueError(f"{fqn!r} is not inside the base model {self.base!r}")
        return fqn[len(self.base) + 1 :]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _plan_of(hf_model: nn.Module) -> dict[str, tuple[Any, Any]]:
    """The model's pipeline plan with FQNs relative to ``hf_model``, or ``{}``."""
    plan = getattr(hf_model, "_pp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return {str(k): tuple(v) for k, v in plan.items()}
    config = getattr(hf_model, "config", None)
    base_plan = getattr(config, "base_model_pp_plan", None)
    prefix = getattr(hf_model, "base_model_prefix", "") or ""
    if isinstance(base_plan, Mapping) and base_plan:
        if prefix and not isinstance(getattr(hf_model, prefix, None), nn.Module):
            prefix = ""
        return {join_fqn(prefix, str(k)): tuple(v) for k, v in base_plan.items()}
    return {}


def _get(root: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        return None


def _from_plan(hf_model: nn.Module, plan: Mapping[str, tuple[Any, Any]]) -> dict[str, str]:
    found: dict[str, str] = {}
    seen_layers = False
    for fqn, spec in plan.items():
        module = _get(hf_model, fqn)
        if module is None:
            continue
        inputs = [str(x) for x in (spec[0] if len(spec) > 0 else ())]
        outputs = [str(x) for x in (spec[1] if len(spec) > 1 else ())]
        if isinstance(module, nn.ModuleList | nn.ModuleDict):
            found["layers"], seen_layers = fqn, True
        elif "logits" in outputs:
            found["head"] = fqn
        elif "input_ids" in inputs and not seen_layers:
            found["embed"] = fqn
        elif seen_layers:
            found["norm"] = fqn
    return found


def _from_names(hf_model: nn.Module, base: str | None = None) -> dict[str, str]:
    if base is None:
        prefix = getattr(hf_model, "base_model_prefix", "") or ""
        base = prefix if isinstance(getattr(hf_model, prefix, None), nn.Module) else ""
    base_module = _get(hf_model, base) if base else hf_model
    found: dict[str, str] = {}
    if base_module is None:
        return found
    for role, names in FALLBACK_NAMES.items():
        for name in names:
            module = getattr(base_module, name, None)
            if role == "layers" and isinstance(module, nn.ModuleList | nn.ModuleDict):
                found[role] = join_fqn(base, name)
                break
            if role != "layers" and isinstance(module, nn.Module):
                found[role] = join_fqn(base, name)
                break
    return found


def _from_blocks(hf_model: nn.Module) -> dict[str, str]:
    """Roles from the container of the blocks transformers declares (``_no_split_modules``).

    The layer container is the largest ``nn.ModuleList`` whose children are all of a declared block
    class; the base model is its parent, searched for the other roles by name.
    """
    declared = {str(n) for m in hf_model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    best: tuple[int, str] | None = None
    for fqn, module in hf_model.named_modules():
        children = list(module.children())
        blocks = bool(children) and all(type(c).__name__ in declared for c in children)
        if isinstance(module, nn.ModuleList) and blocks and (best is None or len(children) > best[0]):
            best = (len(children), fqn)
    if best is None:
        return {}
    layers = best[1]
    found = _from_names(hf_model, layers.rpartition(".")[0])
    found["layers"] = layers
    return found


def _ancestors(fqn: str) -> Iterator[str]:
    parts = fqn.split(".")
    for i in range(len(parts)):
        yield ".".join(parts[:i])


def resolve_decoder_layout(model: nn.Module) -> DecoderLayout:
    """Find the embeddings, layers, final norm, LM head and shared modules of a decoder model.

    Works on peft-wrapped models (FQNs then start with the wrapper's prefix, e.g. ``base_model.model.``)
    and on meta-device models.

    Args:
        model: A transformers decoder (``*ForCausalLM`` or a bare base model), possibly peft-wrapped.

    Returns:
        The layout, with FQNs relative to ``model``.

    Raises:
        ValueError: No layer container was found; the message says what the model would need to declare.
    """
    prefix, hf_model = find_hf_model(model)
    roles = _from_plan(hf_model, _plan_of(hf_model)) or _from_names(hf_model)
    if "layers" not in roles:
        roles = _from_blocks(hf_model)
    if "layers" not in roles:
        raise ValueError(
            f"cannot find the decoder layers of {type(hf_model).__name__}: it declares no _pp_plan / "
            f"config.base_model_pp_plan and has no nn.ModuleList named {list(FALLBACK_NAMES['layers'])}; "
            "split it explicitly with module_fqns_per_model_part"
        )
    if "head" not in roles:
        head = embedding_module(hf_model, "output")
        if head is not None and (fqn := fqn_of(hf_model, head)):
            roles["head"] = fqn
        else:
            name = next(
                (n for n in FALLBACK_HEAD_NAMES if isinstance(getattr(hf_model, n, None), nn.Module)), None
            )
            if name is not None and name != roles["layers"].partition(".")[0]:
                roles["head"] = name
    container = hf_model.get_submodule(roles["layers"])
    layer_names = tuple(name for name, _ in container.named_children())
    base = roles["layers"].rpartition(".")[0]

    assigned = {roles[r] for r in ("embed", "layers", "norm", "head") if r in roles}
    path = set(_ancestors(roles["layers"])) | {a for f in assigned for a in _ancestors(f)}
    extras: list[str] = []
    shared: list[str] = []
    for fqn, module in hf_model.named_modules():
        if not fqn or fqn in path or fqn in assigned:
            continue
        parent = fqn.rpartition(".")[0]
        if parent not in path:  # only direct children of the path; deeper modules travel with them
            continue
        (extras if _has_params(module) else shared).append(fqn)
    after, unknown, reason, problems, probe = _probe_layout(
        hf_model, base, roles["layers"], roles.get("embed"), roles.get("norm"), extras
    )

    def full(fqn: str | None) -> str | None:
        return None if fqn is None else join_fqn(prefix, fqn)

    return DecoderLayout(
        base=join_fqn(prefix, base),
        layers=join_fqn(prefix, roles["layers"]),
        layer_names=layer_names,
        embed=full(roles.get("embed")),
        norm=full(roles.get("norm")),
        head=full(roles.get("head")),
        first_extras=tuple(join_fqn(prefix, f) for f in extras if f not in after and f not in unknown),
        last_extras=tuple(join_fqn(prefix, f) for f in extras if f in after),
        unplaced=tuple(join_fqn(prefix, f) for f in unknown),
        unplaced_reason=reason,
        problems=tuple(problems),
        shared=tuple(join_fqn(prefix, f) for f in shared),
        embed_given_embeds=probe is not None and probe.embeds_given_embeds,
        layer_output_arity=_arity(probe, len(layer_names)),
    )


def _probe_layout(
    hf_model: nn.Module, base: str, layers: str, embed: str | None, norm: str | None, extras: Sequence[str]
) -> tuple[set[str], list[str], str, list[str], ForwardProbe | None]:
    """Place ``extras`` and check the forward's chaining and isolation (`automodel_pipelining.probe`).

    Returns:
        ``(after, unknown, why, problems, probe)``: the extras the forward calls after its layers (last
        stage; extras outside the base model run after it); those whose order is unknown because the
        forward does not run on fake tensors, and why; what keeps a stage from computing exactly what
        the model computes (empty when nothing does); and the probe itself (``None`` when the forward
        does not run on fake tensors).
    """
    inside = [f for f in extras if f.rpartition(".")[0] == base]
    outside = {f for f in extras if f not in inside}
    base_module = hf_model.get_submodule(base) if base else hf_model

    def relative(fqn: str) -> str:
        return fqn[len(base) + 1 :] if base else fqn

    watched = [relative(f) for f in inside]
    if norm is not None and norm.rpartition(".")[0] == base:
        watched.append(relative(norm))
    probe, why = probe_forward(
        base_module,
        relative(layers),
        embed=relative(embed) if embed is not None and embed.rpartition(".")[0] == base else None,
        watched=watched,
    )
    if probe is None:
        return outside, inside, why[:400], [why[:400]], None
    order = probe.order
    cut = order.index(LAYERS_MARK) if LAYERS_MARK in order else len(order)
    placed = {f for f in inside if relative(f) in order[cut + 1 :]}
    return outside | placed, [], "", list(dict.fromkeys(probe.problems)), probe


def _arity(probe: ForwardProbe | None, num_layers: int) -> tuple[int, ...] | None:
    """Each layer's output structure as the probe saw it, or ``None`` when the real layers did not run."""
    if probe is None or not probe.with_layers or len(probe.output_arity) != num_layers:
        return None
    return tuple(probe.output_arity)
