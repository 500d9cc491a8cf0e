"""Build one pipeline stage's module from the full model; its forward is the model's own forward.

A stage module is the full model's module tree pruned to the FQNs the stage owns: the modules on the
path to an owned module are *shell copies* (new module objects with their own child and hook tables,
sharing no parameters), owned modules are the full model's own objects (moved, not copied), parameter-
free shared modules (rotary embeddings) are deep-copied per stage. The layer container keeps its length
and the layers their indices, so parameter names stay those of the full model
(``model.layers.5.mlp.up_proj.weight``) and checkpoints load into stages; the layers other stages own are
replaced by parameter-free stand-ins.

The stage forward runs **the model's own forward**, so masks and rotary embeddings per layer type,
scaled embeddings, logit soft-capping, linear-attention layers and index-based layer loops are computed
exactly as transformers computes them:

- the first stage calls it with the token ids; a later stage calls it with a zero ``inputs_embeds`` of
  the received activations' shape (what runs before the layers is recomputed from it and discarded) and
  the stand-ins for the earlier stages' layers hand the received activations to its first own layer;
- a stage that is not the last ends where its last own layer ends: the stand-in of the next layer (or of
  the final norm) stops the forward and its input is the stage's output;
- the last stage runs the causal-LM wrapper's forward (final norm, LM head, logit scaling or soft-capping)
  and returns the logits.

Other modules with parameters outside the layers go to the stage that calls them (`DecoderLayout`
places them by the order the model calls them); on other stages they are stand-ins too.

Because owned modules are moved rather than copied, building the stages costs no parameter memory, and
the full model must not be used afterwards (its blocks belong to the stages).
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel_modules import is_dtensor, mark_sequence_shards, mark_stream_continues, sequence_shards
from automodel_pipelining.layout import DecoderLayout

__all__ = ["StageForwardSpec", "build_stage_module", "share_sequence_shards"]

_SPEC_ATTR = "_automodel_pp_spec"  # where a patched module keeps its StageForwardSpec
_RECEIVED_ATTR = "_automodel_pp_received"  # and the stage input its earlier layers' stand-ins return

# Keyword arguments that transformers' own forwards pass down and that a stage can ignore when unset.
_IGNORABLE_KWARGS = frozenset(
    {"cache", "past_key_values", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
     "cache_position", "labels", "logits_to_keep"}
)  # fmt: skip


@dataclass
class _Received:
    """The activations a stage received, handed to its first own layer by the earlier layers' stand-ins."""

    value: torch.Tensor | None = None


class _StageBoundary(Exception):
    """Raised by the stand-in that follows a stage's last own layer; carries that layer's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("end of pipeline stage")
        self.hidden = hidden


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    for value in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    raise RuntimeError("a pipeline stage stand-in was called without a tensor argument")


class _EarlierLayer(nn.Module):
    """Stands for a layer an earlier stage owns: returns the activations this stage received."""

    def __init__(self, received: _Received, arity: int) -> None:
        super().__init__()
        self._received = received
        self._arity = arity

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The received activations, in the form the layer it stands for returns its output.

        ``arity`` 0 returns the tensor; ``n`` a tuple of ``n`` whose other items (attention weights,
        router logits) are ``None``, which the models' forwards only collect when asked to.
        """
        if self._received.value is None:
            raise RuntimeError("a pipeline stage ran its earlier layers' stand-ins without a stage input")
        if self._arity == 0:
            return self._received.value
        return (self._received.value, *([None] * (self._arity - 1)))


class _LaterModule(nn.Module):
    """Stands for a layer (or the final norm) a later stage owns: ends this stage with its input."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Stop the stage's forward; the first tensor argument is the stage output."""
        raise _StageBoundary(_first_tensor(args, kwargs))


class _EmbeddingPassThrough(nn.Module):
    """Stands for the input embedding on a later stage whose model forward calls it with ``inputs_embeds``.

    It hands them on: what the forward computes from them before the layers is discarded there.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The ``inputs_embeds`` it was given."""
        embeds = kwargs.get("inputs_embeds")
        if isinstance(embeds, torch.Tensor):
            return embeds
        return next(a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())


class _OtherStageModule(nn.Module):
    """Stands for a module with parameters that another stage runs before the layers.

    Only the part of the forward whose result this stage discards calls it (the earlier layers'
    stand-ins hand the received activations on whatever it computed), so it returns a zero scalar, which
    every shape accepts (a position embedding added to the discarded embeddings, a projection of them).
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """A zero that broadcasts to any shape, on the device of its first tensor input.

        Without a tensor input, on the host: a 0-dim host tensor combines with a tensor on any device.
        """
        inputs = (*args, *kwargs.values())
        device = next((a.device for a in inputs if isinstance(a, torch.Tensor)), torch.device("cpu"))
        return torch.zeros((), device=device)


@dataclass(frozen=True)
class StageForwardSpec:
    """Where the stage forward finds its parts (attribute paths relative to the module it patches)."""

    base: str
    """The base model, relative to the patched module (``""``: the patched module is the base model)."""
    run_outer: bool
    """Whether the last stage runs the patched module's own (causal-LM) forward rather than the base's."""
    embed_dim: int | None
    """Width of the input embedding's output (it can differ from the hidden size: OPT projects it in)."""
    stage_index: int
    num_stages: int
    keep_dtensor_logits: bool = False
    """Hand DTensor logits (vocab-sharded under TP) to the loss as they are: the loss declares it takes
    them (`accepts_dtensor_logits`), so no rank gathers ``tokens x vocab`` values."""

    @property
    def is_first(self) -> bool:
        """Whether this is the first stage (it takes token ids)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last stage (it returns logits)."""
        return self.stage_index == self.num_stages - 1


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


@dataclass
class _Pruning:
    keep: set[str]
    copy_whole: set[str]
    layout: DecoderLayout
    stand_ins: dict[str, nn.Module]


def _prune(module: nn.Module, fqn: str, ctx: _Pruning) -> nn.Module | None:
    if fqn in ctx.keep:
        return copy.deepcopy(module) if fqn in ctx.copy_whole else module
    if fqn in ctx.stand_ins:
        return ctx.stand_ins[fqn]
    if not any(_prefix_of(fqn, k) for k in (*ctx.keep, *ctx.stand_ins)):
        return None
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
        shell._modules[name] = None if child is None else _prune(child, child_fqn, ctx)
    return shell


def _returns_tuple(layer: nn.Module) -> bool:
    """Whether a decoder layer returns a tuple (older transformers layers) rather than the hidden states."""
    forward = type(layer).forward
    try:
        hint = typing.get_type_hints(forward).get("return")
    except Exception:  # unresolvable annotations: read the raw one
        hint = inspect.signature(forward).return_annotation
    text = str(hint).lower()
    return typing.get_origin(hint) is tuple or text.startswith("tuple") or "tuple[" in text


def _copy_plain_attributes(layer: nn.Module, stand_in: nn.Module) -> None:
    """Give ``stand_in`` the layer's public non-tensor attributes (``layer_type``, ``block_type``, ...).

    Model forwards read them off the layer before calling it (to pick its mask, for example).
    """
    for name, value in vars(layer).items():
        if name.startswith("_") or name == "training" or isinstance(value, nn.Module | torch.Tensor):
            continue
        setattr(stand_in, name, value)


def _stand_ins(
    layout: DecoderLayout, fqns: Sequence[str], stage_index: int, num_stages: int, layers: nn.Module
) -> tuple[dict[str, nn.Module], _Received]:
    owned = [i for i, fqn in enumerate(layout.layer_fqns) if fqn in fqns]
    if stage_index > 0 and owned and owned[0] == 0:
        raise ValueError(
            f"pipeline stage {stage_index} starts at layer 0: the first stage must own at least one "
            "decoder layer (its own layers follow the embedding); move a layer to stage 0"
        )
    received = _Received()
    if layout.layer_output_arity is not None:
        arity = layout.layer_output_arity
    else:  # the layers did not run on fake tensors: read the annotation of the stage's first own layer
        hinted = any(_returns_tuple(layers.get_submodule(layout.layer_names[i])) for i in owned[:1])
        arity = (1 if hinted else 0,) * len(layout.layer_fqns)
    stand_ins: dict[str, nn.Module] = {}
    first, last = (owned[0], owned[-1]) if owned else (len(layout.layer_fqns), -1)
    for i, fqn in enumerate(layout.layer_fqns):
        if fqn in fqns:
            continue
        stand_in: nn.Module | None = None
        if i < first and stage_index > 0:
            stand_in = _EarlierLayer(received, arity[i])
        elif i > last:
            stand_in = _LaterModule()
        if stand_in is not None:
            _copy_plain_attributes(layers.get_submodule(layout.layer_names[i]), stand_in)
            stand_ins[fqn] = stand_in
    if stage_index < num_stages - 1:
        for later in (layout.norm, *layout.last_extras):
            if later is not None and later not in fqns:
                stand_ins[later] = _LaterModule()
    # The input embedding stays None on later stages: the model's forward skips it when given
    # inputs_embeds, and plans that look for it (FSDP units, tied weights) must not find a stand-in;
    # only a forward that calls it anyway gets one.
    if (
        stage_index > 0
        and layout.embed_given_embeds
        and layout.embed is not None
        and layout.embed not in fqns
    ):
        stand_ins[layout.embed] = _EmbeddingPassThrough()
    for fqn in (*layout.first_extras, *layout.last_extras, *layout.unplaced):
        if fqn not in fqns and fqn not in stand_ins:
            stand_ins[fqn] = _OtherStageModule()
    return stand_ins, received


# ----------------------------------------------------------------------------------------- forward


def _child(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path) if path else module


def _first_output(output: Any) -> torch.Tensor:
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


@functools.cache
def _keywords_taken(forward: Any) -> frozenset[str] | None:
    """The keyword names ``forward`` takes; ``None`` when it takes ``**kwargs``.

    Cached per function: the stage forward runs once per microbatch, and reading a signature costs
    about 0.2 ms (a few percent of a small stage's forward on CPU).
    """
    parameters = inspect.signature(forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


def _accepted(forward: Any, call: dict[str, Any]) -> dict[str, Any]:
    """``call`` without the keywords ``forward`` does not take (position ids of a model without positions)."""
    taken = _keywords_taken(forward)
    if taken is None:
        return call
    return {k: v for k, v in call.items() if k in taken}


def _stage_forward(
    self: nn.Module,
    inputs: torch.Tensor | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Token ids (first stage) or received activations in; activations, or logits on the last stage, out."""
    spec: StageForwardSpec = getattr(self, _SPEC_ATTR)
    received: _Received = getattr(self, _RECEIVED_ATTR)
    _check_kwargs(spec, kwargs)
    x = inputs if inputs is not None else input_ids if input_ids is not None else inputs_embeds
    if x is None:
        raise ValueError(f"pipeline stage {spec.stage_index} got no input tensor")
    call: dict[str, Any] = {
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "use_cache": False,
    }
    if spec.is_first:
        if x.is_floating_point():
            raise ValueError(f"the first pipeline stage takes token ids, got a {x.dtype} tensor")
        call["input_ids"] = x
    elif not x.is_floating_point():
        raise ValueError(
            f"pipeline stage {spec.stage_index} of {spec.num_stages} has no input embedding but got integer "
            f"inputs of shape {tuple(x.shape)}; only the first stage takes token ids"
        )
    else:
        # What the model computes from its embeddings before the first layer is discarded: the
        # earlier layers' stand-ins hand the received activations to this stage's first own layer.
        # Under sequence parallelism ``x`` is this rank's slice of the sequence: masks, positions and
        # the blocks' sequence-length hook must see the whole of it.
        width = spec.embed_dim if spec.embed_dim is not None else x.shape[-1]
        length = x.shape[1] * sequence_shards(self)
        call["inputs_embeds"] = x.new_zeros((x.shape[0], length, *x.shape[2:-1], width))
        received.value = x
    target = self if spec.is_last and spec.run_outer else _child(self, spec.base)
    forward = type(target).forward
    try:
        output = forward(target, **_accepted(forward, call))
    except _StageBoundary as boundary:
        if spec.is_last:
            raise RuntimeError(
                f"the last pipeline stage ({spec.stage_index}) reached a module of another stage"
            ) from None
        return _to_local_full(boundary.hidden)
    finally:
        received.value = None
    if not spec.is_last:
        raise RuntimeError(
            f"pipeline stage {spec.stage_index} ran the model's forward to its end without reaching the "
            "next stage's first layer; the model's forward does not call its layers in order"
        )
    logits = _first_output(output)
    return logits if spec.keep_dtensor_logits else _to_local_full(logits)


def share_sequence_shards(stage: nn.Module) -> int:
    """Hand the stage's sequence-parallel mark to the modules whose forward the stage patched.

    Sequence parallelism marks the module it was applied to (the stage, or the transformers model inside
    a wrapper); the stage forward may be installed on another module of the stage. Mutates those
    modules' mark; returns the number of slices.
    """
    shards = max(sequence_shards(module) for module in stage.modules())
    for module in stage.modules():
        if hasattr(module, _SPEC_ATTR):
            mark_sequence_shards(module, shards)
    return shards


def _output_to_tensor_hook(_module: nn.Module, _args: Any, output: Any) -> torch.Tensor:
    return _to_local_full(_first_output(output))


def build_stage_module(
    model: nn.Module,
    layout: DecoderLayout,
    fqns: Sequence[str],
    *,
    stage_index: int,
    num_stages: int,
    patch_inner_model: bool = True,
    patch_causal_lm_model: bool = True,
    keep_dtensor_logits: bool = False,
) -> nn.Module:
    """Prune ``model`` to the modules ``fqns`` and install the stage forward.

    The returned module has the full model's class and module paths; the layer container keeps every
    index (layers of other stages are parameter-free stand-ins) and other modules the stage does not own
    are stand-ins or ``None``. Its forward (with ``patch_causal_lm_model``; with ``patch_inner_model`` and
    a bare base model or an unpatched wrapper, the base model's) takes one tensor (token ids on the first
    stage, activations elsewhere) plus optional ``position_ids`` and ``attention_mask`` keyword inputs,
    runs the model's own forward (see the module docstring) and returns one tensor (logits on the last
    stage, activations elsewhere; a DTensor output is gathered to a full tensor, except the last stage's
    logits with ``keep_dtensor_logits``, for a loss that takes them as they are). Without either patch
    the stage keeps the model's forward.

    Preconditions: ``fqns`` was validated against ``layout`` (see `automodel_pipelining.split`); a stage
    after the first does not own layer 0. The model may be on the meta device. ``model``'s own modules
    are shared with (moved to) the stage; ``model`` itself is not modified.

    Returns:
        The stage module.

    Raises:
        ValueError: A shell module owns parameters of its own, or a later stage owns layer 0.
    """
    keep = set(fqns)
    copy_whole = {fqn for fqn in fqns if next(model.get_submodule(fqn).parameters(), None) is None}
    stand_ins, received = _stand_ins(
        layout, fqns, stage_index, num_stages, model.get_submodule(layout.layers)
    )
    stage = _prune(model, "", _Pruning(keep, copy_whole, layout, stand_ins))
    if stage is None:  # pragma: no cover - the root is an ancestor of every FQN
        raise ValueError(f"stage {stage_index} owns no modules")
    base_module = _child(stage, layout.base)
    if stage_index < num_stages - 1:  # sequence parallelism: its last block hands a slice on
        # Every module from the root to the base model: tensor parallelism may be applied to any of
        # them (a peft wrapper, the causal LM inside it, the base model).
        segments = layout.base.split(".") if layout.base else []
        for depth in range(len(segments) + 1):
            mark_stream_continues(_child(stage, ".".join(segments[:depth])))
    patched: nn.Module | None = None
    if patch_causal_lm_model:
        patched = stage
    elif patch_inner_model:
        patched = base_module
    if patched is None:
        stage.register_forward_hook(_output_to_tensor_hook)
        return stage
    relative = layout.base if patched is stage else ""
    embedding = model.get_submodule(layout.embed) if layout.embed is not None else None
    weight = getattr(embedding, "weight", None)
    spec = StageForwardSpec(
        base=relative,
        run_outer=patched is not base_module,
        embed_dim=int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None,
        stage_index=stage_index,
        num_stages=num_stages,
        keep_dtensor_logits=keep_dtensor_logits,
    )
    setattr(patched, _SPEC_ATTR, spec)
    setattr(patched, _RECEIVED_ATTR, received)
    patched.forward = types.MethodType(_stage_forward, patched)
    if patched is not stage:
        stage.register_forward_hook(_output_to_tensor_hook)
    return stage
