"""Where a model's experts are: found from the model's own metadata, with a registry for the rest.

transformers 5 describes the experts of its MoE families itself, in two ways we read:

- the experts class is decorated with ``use_experts_implementation(is_concatenated=, is_transposed=,
  has_bias=, has_gate=, has_post_expert_norm=)`` (``transformers/integrations/moe.py``): its instances
  carry those flags, keep every expert's weights stacked on dim 0, and are called as ``experts(hidden
  [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``, the forward dispatching through
  ``ExpertsInterface``;
- the model's expert-parallel plan (``model.ep_plan``, from the config's ``base_model_ep_plan``) names
  the experts modules (style ``ep_dispatch_experts``) and the parameters cut by expert (``grouped_gemm``).

`find_experts` returns one `ExpertsSite` per experts module from those, with no per-family record.
`MoEFamily` records (`register_moe_family`) cover experts classes outside that convention (Llama 4's
experts take every token, pre-scaled by its router score) or override what the metadata says. The sparse
block's own forward (router, grouped top-k, correction biases, shared experts, router logits for the aux
loss) always runs unchanged: only the experts' compute is distributed.

A module wrapped by peft (LoRA on the fused expert weights through ``target_parameters``: a chain of
``ParamWrapper``s whose innermost ``base_layer`` is the experts module) is one site: ``module`` is the
outermost wrapper (what the block calls), ``core`` the experts module holding the weights.

Imports only torch; no transformers model class is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from torch import nn

__all__ = [
    "MOE_FAMILIES",
    "ExpertsCall",
    "ExpertsSite",
    "MoEFamily",
    "expert_weight_targets",
    "find_experts",
    "find_routers",
    "has_experts",
    "register_moe_family",
    "wrapper_chain",
]

# The attributes `use_experts_implementation` sets on every instance of a decorated experts class (since
# transformers 5.17; later versions add ``_is_expert_parallel``, which the convention does not need).
_CONVENTION_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
_DISPATCH_STYLES = ("ep_dispatch_experts", "moe_tp_experts")  # the second: transformers 5.17's ep plans
_PARAM_STYLE = "grouped_gemm"


class ExpertsCall(StrEnum):
    """How the sparse block calls its experts module (what the dispatch must send and bring back)."""

    ROUTED = "routed"
    """``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``: each token goes to
    the K experts it picked (transformers' experts convention)."""
    EVERY_TOKEN = "every_token"
    """``experts(rows [E * T, H]) -> [E * T, H]``: every expert gets every token (rows expert-major,
    already scaled by the router), as Llama 4's experts are called."""
    GROUPED_ROWS = "grouped_rows"
    """``experts(rows [N, in], counts [E]) -> [N, out]``: the rows of each expert contiguous and in expert
    order, ``counts[e]`` of them (the block routed and sorted the tokens), as JetMoE's parallel experts
    are called (two of them per block, with the activation between them computed by the block)."""


@dataclass(frozen=True, kw_only=True)
class MoEFamily:
    """An experts class that the model's metadata does not describe (or describes wrongly).

    Looked up by the class name of the experts module (``core``), before the metadata.
    """

    experts_class: str
    """Class name of the experts module (the one that holds the stacked expert weights)."""
    call: ExpertsCall = ExpertsCall.ROUTED
    """How the block calls it."""
    expert_params: tuple[str, ...] = ()
    """Its parameters stacked by expert on dim 0; empty: every direct parameter whose dim 0 is the
    expert count."""
    num_experts_attr: str = "num_experts"
    """Its attribute holding the expert count (set to the local count once sharded)."""
    note: str = ""
    """Why the record exists (shown in docs)."""


MOE_FAMILIES: dict[str, MoEFamily] = {}
"""Experts class name -> `MoEFamily` (the overrides; most families need none)."""


def register_moe_family(family: MoEFamily, *, overwrite: bool = False) -> MoEFamily:
    """Register ``family`` (one call); ``ValueError`` if its class is registered and not ``overwrite``."""
    if not isinstance(family, MoEFamily):
        raise ValueError(f"register_moe_family needs a MoEFamily, got {type(family).__name__}")
    if family.experts_class in MOE_FAMILIES and not overwrite:
        raise ValueError(
            f"MoE experts class {family.experts_class!r} is already registered; pass overwrite=True"
        )
    MOE_FAMILIES[family.experts_class] = family
    return family


register_moe_family(
    MoEFamily(
        experts_class="Llama4TextExperts",
        call=ExpertsCall.EVERY_TOKEN,
        num_experts_attr="num_experts",
        note="Llama 4's experts take every token pre-scaled by its router score (transformers gives the "
        "family no ep plan: nothing to route), so each rank receives its experts' copies of every token",
    )
)


register_moe_family(
    MoEFamily(
        experts_class="JetMoeParallelExperts",
        call=ExpertsCall.GROUPED_ROWS,
        note="JetMoE's experts are two stacked linear maps per block (input and output), in its MoE "
        "feed-forward and in its mixture-of-attention heads alike, each called with the rows the block "
        "sorted by expert and the per-expert counts",
    )
)


@dataclass(frozen=True, eq=False)
class ExpertsSite:
    """One experts module of a model and how to shard it.

    Attributes:
        fqn: Name of ``module`` in the model.
        module: What the sparse block calls: the experts module, or the outermost peft wrapper around it.
        core: The experts module that holds the stacked weights (``module`` itself without peft).
        num_experts: The (global) expert count.
        params: Names of ``core``'s parameters stacked by expert on dim 0 (cut over ``ep``).
        call: How the block calls ``module``.
        source: Where the description came from: ``"ep_plan"``, ``"experts_implementation"`` (the
            decorator's metadata) or ``"registry"``.
        num_experts_attr: ``core``'s attribute holding the expert count.
    """

    fqn: str
    module: nn.Module
    core: nn.Module
    num_experts: int
    params: tuple[str, ...]
    call: ExpertsCall
    source: str
    num_experts_attr: str = "num_experts"


def _wildcard(fqn: str) -> str:
    # transformers' plan keys name layers ``layers.*``: numbers between dots become ``*``.
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), fqn)


def _ep_plan(model: nn.Module) -> Mapping[str, str]:
    plan = getattr(model, "ep_plan", None)  # a transformers model merges its config's base_model_ep_plan
    return plan if isinstance(plan, Mapping) else {}


def wrapper_chain(module: nn.Module) -> list[nn.Module]:
    """``module`` and the ``base_layer``s under it (peft's wrappers), outermost first."""
    chain = [module]
    while isinstance(inner := getattr(chain[-1], "base_layer", None), nn.Module):
        chain.append(inner)
    return chain


def _stacked_params(core: nn.Module, num_experts: int) -> tuple[str, ...]:
    return tuple(
        name
        for name, p in core._parameters.items()
        if p is not None and p.dim() >= 1 and p.shape[0] == num_experts
    )


def _count(core: nn.Module, attr: str, params: tuple[str, ...]) -> int | None:
    value = getattr(core, attr, None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    shapes = {p.shape[0] for name in params if (p := core._parameters.get(name)) is not None}
    return shapes.pop() if len(shapes) == 1 else None


SHARDED_ATTR = "_automodel_expert_site"
"""Attribute `automodel_moe.experts.shard_experts` sets on an experts module it cut: the site as found
before (its expert count attribute is then the local one)."""


def _site(fqn: str, module: nn.Module, plan: Mapping[str, str]) -> ExpertsSite | None:
    core = wrapper_chain(module)[-1]
    sharded = core.__dict__.get(SHARDED_ATTR)
    if isinstance(sharded, ExpertsSite):
        return ExpertsSite(
            fqn, module, core, sharded.num_experts, sharded.params, sharded.call, sharded.source,
            sharded.num_experts_attr,
        )  # fmt: skip
    key = _wildcard(fqn)
    family = MOE_FAMILIES.get(type(core).__name__)
    if family is not None:
        params = family.expert_params
        count = _count(core, family.num_experts_attr, params)
        if count is None:
            return None
        return ExpertsSite(
            fqn, module, core, count, params or _stacked_params(core, count), family.call, "registry",
            family.num_experts_attr,
        )  # fmt: skip
    if plan.get(key) in _DISPATCH_STYLES:
        named = tuple(
            name
            for name in core._parameters
            if plan.get(f"{key}.{name}") == _PARAM_STYLE and core._parameters[name] is not None
        )
        count = _count(core, "num_experts", named)
        if count is not None:
            return ExpertsSite(
                fqn, module, core, count, named or _stacked_params(core, count), ExpertsCall.ROUTED, "ep_plan"
            )
    if all(hasattr(core, flag) for flag in _CONVENTION_FLAGS):
        count = _count(core, "num_experts", ())
        if count is not None:
            params = _stacked_params(core, count)
            return ExpertsSite(fqn, module, core, count, params, ExpertsCall.ROUTED, "experts_implementation")
    return None


def find_experts(model: nn.Module) -> list[ExpertsSite]:
    """Every experts module of ``model``, in module order (empty for a dense model).

    Looks, for each module that is not some wrapper's ``base_layer``: at the registry (by the experts
    class name), then the model's ep plan (``ep_dispatch_experts`` / ``grouped_gemm``), then the
    ``use_experts_implementation`` metadata. Pure: nothing is changed.
    """
    plan = _ep_plan(model)
    inner = {
        id(m.base_layer) for m in model.modules() if isinstance(getattr(m, "base_layer", None), nn.Module)
    }
    sites: list[ExpertsSite] = []
    for fqn, module in model.named_modules():
        if id(module) in inner:
            continue
        site = _site(fqn, module, plan)
        if site is not None:
            sites.append(site)
    return sites


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` looks like a mixture of experts.

    True for an experts module `find_experts` finds, or a module class named ``*Experts`` (which
    `find_experts` may not know how to shard). An ep plan alone is not enough: a config can switch its
    experts off (Gemma 4's ``enable_moe_block=False``) and keep the plan.
    """
    return bool(find_experts(model)) or any(type(m).__name__.endswith("Experts") for m in model.modules())


def _router_specs(model: nn.Module) -> list[tuple[type | None, str | None, str | None]]:
    """``(class, layer name, class-name suffix)`` of each ``router_logits`` recorder the model declares."""
    specs: list[tuple[type | None, str | None, str | None]] = []
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None)
        entry = recorders.get("router_logits") if isinstance(recorders, Mapping) else None
        for spec in entry if isinstance(entry, list | tuple) else [entry]:
            if isinstance(spec, type):
                specs.append((spec, None, None))
            elif spec is not None and hasattr(spec, "target_class"):  # transformers' OutputRecorder
                specs.append((spec.target_class, spec.layer_name, spec.class_name))
    return specs


def find_routers(model: nn.Module) -> list[str]:
    """The FQNs of ``model``'s routers, in module order (empty when the model declares none).

    A router is found from transformers' own output-capture metadata: the modules its models record
    ``router_logits`` from (``_can_record_outputs["router_logits"]``: an ``OutputRecorder`` naming the
    router class, and possibly a layer name or a class-name suffix). Pure: nothing is changed.
    """
    specs = _router_specs(model)
    found: list[str] = []
    for fqn, module in model.named_modules():
        for target, layer_name, class_name in specs:
            if target is not None and not isinstance(module, target):
                continue
            if layer_name is not None and layer_name not in fqn:
                continue
            if class_name is not None and not type(module).__name__.endswith(class_name):
                continue
            found.append(fqn)
            break
    return found


def expert_weight_targets(model: nn.Module) -> list[str]:
    """The stacked expert weights of ``model`` as LoRA parameter targets (empty for a dense model).

    Each is ``<experts module's name>.<parameter>`` (``experts.gate_up_proj``, ``experts.down_proj``)
    for a parameter `find_experts` reports stacked by expert with one matrix per expert (3-D), the form
    `automodel_peft.PeftConfig.target_parameters` takes: one rank-``dim`` adapter per expert. Biases
    (2-D) are left out. Pure.
    """
    return sorted(
        {
            f"{site.fqn.rpartition('.')[2]}.{name}"
            for site in find_experts(model)
            for name in site.params
            if getattr(site.core, name).dim() == 3
        }
    )
