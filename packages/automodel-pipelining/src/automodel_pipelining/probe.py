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

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
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


class _Trace:
    """The hooks of one probing forward: they fill a `ForwardProbe` (see the module docstring)."""

    def __init__(self, with_layers: bool) -> None:
        self.probe = ForwardProbe(with_layers=with_layers)
        self.labels = DataFlow()
        self.previous: torch.Tensor | None = None
        self.first_inputs: dict[str, frozenset[str]] = {}
        self.embed_width: list[int] = []

    def before_layer(
        self, index: int, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        probe = self.probe
        if index == 0:
            probe.order.append(LAYERS_MARK)
        hidden, rest = _hidden(args, kwargs)
        if index > 0 and self.previous is not None and hidden is not self.previous:
            probe.problems.append(
                f"the forward changes the hidden states between layers {index - 1} and {index} (a stage "
                "boundary there would apply that change twice)"
            )
        side = self.labels.labels_of(rest)
        if side:
            probe.problems.append(
                f"layer {index} gets inputs computed from {', '.join(sorted(side))} besides its hidden "
                "states (a later stage would not have them)"
            )

    def after_layer(self, index: int, _module: nn.Module, _args: Any, output: Any) -> None:
        self.labels.set(output, {f"layer {index}'s output"})
        if self.probe.with_layers:
            self.probe.output_arity.append(len(output) if isinstance(output, tuple | list) else 0)
        self.previous = _first_tensor(output)

    def before_watched(
        self, name: str, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        order = self.probe.order
        if name not in self.first_inputs:
            order.append(name)
            self.first_inputs[name] = self.labels.labels_of((args, kwargs))
        elif LAYERS_MARK in order and order.index(name) < order.index(LAYERS_MARK):
            problem = (
                f"{name} runs both before and after the layers (the first and the last stage would both "
                "need its parameters)"
            )
            if problem not in self.probe.problems:
                self.probe.problems.append(problem)

    def after_embed(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self.labels.set(output, {_EMBEDDINGS})
        if isinstance(output, torch.Tensor):
            self.embed_width.append(output.shape[-1])

    def register(
        self, base: nn.Module, layers: list[nn.Module], embed: str | None, watched: Sequence[str]
    ) -> list[Any]:
        """Hook the layers, the embedding and the watched modules; returns the handles."""
        hooks = []
        for index, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(partial(self.before_layer, index), with_kwargs=True))
            hooks.append(layer.register_forward_hook(partial(self.after_layer, index)))
        if embed is not None:
            hooks.append(base.get_submodule(embed).register_forward_hook(self.after_embed))
        for name in watched:
            for module in base.get_submodule(name).modules():  # a ModuleList is called through its children
                hooks.append(
                    module.register_forward_pre_hook(partial(self.before_watched, name), with_kwargs=True)
                )
        return hooks

    def check_after_layers(self, num_layers: int) -> None:
        """Modules after the layers must see nothing but the last layer's output."""
        order, last = self.probe.order, f"layer {num_layers - 1}'s output"
        if LAYERS_MARK not in order:
            self.probe.problems.append("the forward did not call its first layer")
            return
        for name in order[order.index(LAYERS_MARK) + 1 :]:
            extra = self.first_inputs[name] - {last}
            if extra:
                self.probe.problems.append(
                    f"{name} (after the layers) gets inputs computed from {', '.join(sorted(extra))} besides "
                    "the last layer's output"
                )


def _target(base: nn.Module, layers: str, with_layers: bool) -> tuple[nn.Module, list[nn.Module]]:
    """The module whose forward runs, and its layers (pass-through stand-ins in a shallow copy)."""
    if with_layers:
        return base, list(base.get_submodule(layers).children())
    target = copy.copy(base)
    target._modules = dict(base._modules)
    container = nn.ModuleList(_PassThrough() for _ in base.get_submodule(layers).children())
    target._modules[layers] = container
    return target, list(container.children())


def _device(base: nn.Module) -> torch.device:
    param = next(base.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _run(
    base: nn.Module,
    layers: str,
    embed: str | None,
    watched: Sequence[str],
    with_layers: bool,
) -> ForwardProbe:
    trace = _Trace(with_layers)
    target, children = _target(base, layers, with_layers)
    hooks = trace.register(base, children, embed, watched)
    try:
        with fake_forward(trace.labels):
            ids = torch.zeros(1, 8, dtype=torch.long, device=_device(base))
            trace.labels.set(ids, {_TOKEN_IDS})
            type(base).forward(target, input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    if embed is not None and trace.embed_width:
        trace.probe.embeds_given_embeds = _calls_embedding_given_embeds(
            base, target, embed, trace.embed_width[0]
        )
    trace.check_after_layers(len(children))
    return trace.probe


@contextlib.contextmanager
def _adapters_off(base: nn.Module) -> Iterator[None]:
    """PEFT adapter layers of ``base`` switched off for the probe, then restored with ``requires_grad``.

    peft's LoRA on parameters (``target_parameters``: MoE experts) registers a parametrization on every
    call, which fake tensors refuse; without the adapters the layers still return what they return with
    them, which is all the probe reads. An adapter layer is recognised by peft's ``BaseTunerLayer``
    interface: a boolean ``disable_adapters`` and ``enable_adapters(enabled)`` (a transformers model has
    methods of those names instead, and is left alone).
    """
    adapters: list[Any] = [m for m in base.modules() if getattr(m, "disable_adapters", None) is False]
    trainable = {p: p.requires_grad for m in adapters for p in m.parameters()}
    for module in adapters:
        module.enable_adapters(False)
    try:
        yield
    finally:
        for module in adapters:
            module.enable_adapters(True)
        for param, flag in trainable.items():
            param.requires_grad_(flag)


def _calls_embedding_given_embeds(base: nn.Module, target: nn.Module, embed: str, width: int) -> bool:
    """Whether the forward, called the way a later stage calls it (``inputs_embeds``), runs the embedding.

    A forward that fails this way is not judged here (the stage would raise, not compute silently).
    """
    called: list[bool] = []
    hook = base.get_submodule(embed).register_forward_pre_hook(lambda *_: called.append(True))
    try:
        with fake_forward(DataFlow()):
            type(base).forward(target, inputs_embeds=torch.zeros(1, 8, width, device=_device(base)))
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
            with _adapters_off(base):
                return _run(base, layers, embed, watched, with_layers), ""
        except Exception as exc:  # the forward cannot run this way; try the other, then give up
            errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    return None, f"the forward of {type(base).__name__} does not run on fake tensors ({'; '.join(errors)})"
