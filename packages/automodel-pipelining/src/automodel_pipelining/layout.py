"""Where the parts of a decoder model live: embeddings, layers, final norm, LM head, shared modules.

The layout is read from what transformers declares: the model's ``_pp_plan`` (full FQNs, e.g.
``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``) or its config's
``base_model_pp_plan`` (relative to ``base_model_prefix``), then ``get_output_embeddings()`` for the LM
head. Models that declare neither fall back to the conventional names in `FALLBACK_NAMES`. No model family
is named here. Everything only reads the model (meta-device models work).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from automodel_mesh.modules import find_hf_model, fqn_of, join_fqn

__all__ = [
    "FALLBACK_HEAD_NAMES",
    "FALLBACK_NAMES",
    "DecoderLayout",
    "resolve_decoder_layout",
]

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
    """Other modules with parameters beside the layers (e.g. encoders); placed on the first stage."""
    shared: tuple[str, ...] = ()
    """Parameter-free modules every stage needs (rotary embeddings); each stage gets its own copy."""

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
        return tuple(f for f in (self.norm, self.head) if f is not None)

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


def _from_names(hf_model: nn.Module) -> dict[str, str]:
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
        raise ValueError(
            f"cannot find the decoder layers of {type(hf_model).__name__}: it declares no _pp_plan / "
            f"config.base_model_pp_plan and has no nn.ModuleList named {list(FALLBACK_NAMES['layers'])}; "
            "split it explicitly with module_fqns_per_model_part"
        )
    if "head" not in roles:
        get_out = getattr(hf_model, "get_output_embeddings", None)
        head = get_out() if callable(get_out) else None
        if isinstance(head, nn.Module) and (fqn := fqn_of(hf_model, head)):
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

    def full(fqn: str | None) -> str | None:
        return None if fqn is None else join_fqn(prefix, fqn)

    return DecoderLayout(
        base=join_fqn(prefix, base),
        layers=join_fqn(prefix, roles["layers"]),
        layer_names=layer_names,
        embed=full(roles.get("embed")),
        norm=full(roles.get("norm")),
        head=full(roles.get("head")),
        first_extras=tuple(join_fqn(prefix, f) for f in extras),
        shared=tuple(join_fqn(prefix, f) for f in shared),
    )
