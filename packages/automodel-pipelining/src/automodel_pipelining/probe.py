"""One forward of the base model on fake tensors: what a pipeline split needs to know about its code.

A pipeline stage runs the model's own forward and hands only the hidden states of one layer to the next
stage (`automodel_pipelining.stage_module`). That is exact when the model's forward has three
properties, which `probe_forward` reads from one forward of the base model under ``FakeTensorMode`` (no
compute, no memory, meta-device models included):

- the order in which it calls the modules around its layers (an output projection runs after them, a
  position embedding before), to place those modules on the first or the last stage;
- *chaining*: each layer's hidden-states input is the previous layer's output, unchanged (nothing is
  computed between two layers, which a stage boundary would compute twice);
- *isolation*: no layer's other inputs, and no module after the layers, depend on the token ids, the
  embeddings or an earlier layer's output other than through that chain (a later stage has no token
  ids and recomputes the other inputs from a discarded zero embedding, so they must not carry
  information).

Data flow is traced with `automodel_modules.dataflow.DataFlow`, labelling tensors by what they were
computed from: the token ids, the embedding's output, and each layer's output, which starts a new link
of the chain (its labels are reset to that layer alone). The forward first runs with the real layers; models
whose layers cannot run on fake tensors (data-dependent expert routing) run again with pass-through
layers, which still shows what the forward hands to each layer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from automodel_modules.dataflow import DataFlow, fake_forward

__all__ = ["ForwardProbe", "probe_forward"]

LAYERS_MARK = "<layers>"
_EMBEDDINGS = "the embeddings"
_TOKEN_IDS = "the token ids"


@dataclass
class ForwardProbe:
    """What one forward of the base model showed (see the module docstring)."""

    order: list[str] = field(default_factory=list)
    """Names of the watched modules and `LAYERS_MARK` (the first layer), in call order."""
    problems: list[str] = field(default_factory=list)
    """Why a stage could not compute exactly what the model computes (empty: it can)."""
    with_layers: bool = True
    """Whether the real layers ran (else pass-through stand-ins did: layer outputs were not traced)."""
    output_arity: list[int] = field(default_factory=list)
    """Per layer, in call order: ``0`` when it returned a tensor, else the length of the tuple it
    returned (read only when the real layers ran). Type hints are not trusted for this: several
    transformers layers annotate a tuple and return a tensor, or the reverse."""
    embeds_given_embeds: bool = False
    """Whether the forward calls the input embedding even when given ``inputs_embeds`` (it then
    post-processes them, e.g. a norm), as a later stage calls it."""


class _PassThrough(nn.Module):
    """A decoder layer's stand-in: returns its hidden-states input."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, kwargs.get("hidden_states")):
            if isinstance(value, torch.Tensor):
                return value
        raise TypeError("a decoder layer was called without its hidden states")


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, list[Any]]:
    """A layer call's hidden states and its other arguments."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], [*args[1:], *kwargs.values()]
    hidden = kwargs.get("hidden_states")
    rest = [v for k, v in kwargs.items() if k != "hidden_states"]
    return (hidden if isinstance(hidden, torch.Tensor) else None), [*args, *rest]


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return next((leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)), None)


def _run(
    base: nn.Module,
    layers: str,
    embed: str | None,
    watched: Sequence[str],
    with_layers: bool,
) -> ForwardProbe:
    probe = ForwardProbe(with_layers=with_layers)
    labels = DataFlow()
    target = base
    container = base.get_submodule(layers)
    if not with_layers:
        target = copy.copy(base)
        target._modules = dict(base._modules)
        container = nn.ModuleList(_PassThrough() for _ in container.children())
        target._modules[layers] = container
    children = list(container.children())
    previous: list[torch.Tensor | None] = [None]
    first_inputs: dict[str, frozenset[str]] = {}
    hooks: list[Any] = []

    def before_layer(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if index == 0:
                probe.order.append(LAYERS_MARK)
            hidden, rest = _hidden(args, kwargs)
            if index > 0 and previous[0] is not None and hidden is not previous[0]:
                probe.problems.append(
                    f"the forward changes the hidden states between layers {index - 1} and {index} (a stage "
                    "boundary there would apply that change twice)"
                )
            side = labels.labels_of(rest)
            if side:
                probe.problems.append(
                    f"layer {index} gets inputs computed from {', '.join(sorted(side))} besides its hidden "
                    "states (a later stage would not have them)"
                )

        return hook

    def after_layer(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            labels.set(output, {f"layer {index}'s output"})
            if with_layers:
                probe.output_arity.append(len(output) if isinstance(output, tuple | list) else 0)
            previous[0] = _first_tensor(output)

        return hook

    def before_watched(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in first_inputs:
                probe.order.append(name)
                first_inputs[name] = labels.labels_of((args, kwargs))
            elif LAYERS_MARK in probe.order and probe.order.index(name) < probe.order.index(LAYERS_MARK):
                problem = (
                    f"{name} runs both before and after the layers (the first and the last stage would "
                    "both need its parameters)"
                )
                if problem not in probe.problems:
                    probe.problems.append(problem)

        return hook

    for index, layer in enumerate(children):
        hooks.append(layer.register_forward_pre_hook(before_layer(index), with_kwargs=True))
        hooks.append(layer.register_forward_hook(after_layer(index)))
    embed_width: list[int] = []
    if embed is not None:

        def after_embed(_module: nn.Module, _args: Any, output: Any) -> None:
            labels.set(output, {_EMBEDDINGS})
            if isinstance(output, torch.Tensor):
                embed_width.append(output.shape[-1])

        hooks.append(base.get_submodule(embed).register_forward_hook(after_embed))
    for name in watched:
        for module in base.get_submodule(name).modules():  # a ModuleList is called through its children
            hooks.append(module.register_forward_pre_hook(before_watched(name), with_kwargs=True))
    param = next(base.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    try:
        with fake_forward(labels):
            ids = torch.zeros(1, 8, dtype=torch.long, device=device)
            labels.set(ids, {_TOKEN_IDS})
            type(base).forward(target, input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    if embed is not None and embed_width:
        probe.embeds_given_embeds = _calls_embedding_given_embeds(base, target, embed, embed_width[0])
    last = f"layer {len(children) - 1}'s output"
    if LAYERS_MARK in probe.order:
        for name in probe.order[probe.order.index(LAYERS_MARK) + 1 :]:
            extra = first_inputs[name] - {last}
            if extra:
                probe.problems.append(
                    f"{name} (after the layers) gets inputs computed from {', '.join(sorted(extra))} besides "
                    "the last layer's output"
                )
    else:
        probe.problems.append("the forward did not call its first layer")
    return probe


def _calls_embedding_given_embeds(base: nn.Module, target: nn.Module, embed: str, width: int) -> bool:
    """Whether the forward, called the way a later stage calls it (``inputs_embeds``), runs the embedding.

    A forward that fails this way is not judged here (the stage would raise, not compute silently).
    """
    called: list[bool] = []
    hook = base.get_submodule(embed).register_forward_pre_hook(lambda *_: called.append(True))
    param = next(base.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    try:
        with fake_forward(DataFlow()):
            type(base).forward(target, inputs_embeds=torch.zeros(1, 8, width, device=device))
    except Exception:  # not this check's concern
        return False
    finally:
        hook.remove()
    return bool(called)


def probe_forward(
    base: nn.Module,
    layers: str,
    *,
    embed: str | None,
    watched: Sequence[str] = (),
) -> tuple[ForwardProbe | None, str]:
    """Run the base model's forward once on fake tensors and read what a pipeline split needs.

    Args:
        base: The base model (e.g. ``model.model``); not modified (hooks are removed again).
        layers: The layer container, relative to ``base``.
        embed: The input embedding, relative to ``base`` (its output starts the data-flow trace).
        watched: Children of ``base`` whose first call is recorded in `ForwardProbe.order`; those the
            forward calls after its layers must see nothing but the last layer's output.

    Returns:
        ``(probe, "")``, or ``(None, why)`` when the forward does not run on fake tensors.
    """
    errors = []
    for with_layers in (True, False):
        try:
            return _run(base, layers, embed, watched, with_layers), ""
        except Exception as exc:  # the forward cannot run this way; try the other, then give up
            errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    return None, f"the forward of {type(base).__name__} does not run on fake tensors ({'; '.join(errors)})"
