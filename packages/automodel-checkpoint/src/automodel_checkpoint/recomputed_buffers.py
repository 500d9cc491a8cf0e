"""Buffers after meta init: what a fresh construction of the model computes for them.

Buffers that no checkpoint holds (non-persistent ones: rotary ``inv_freq``, Gemma's ``embed_scale``,
MiniMax's decay tables; and persistent ones a checkpoint may lack) hold garbage after ``to_empty``. Their
value is what the model's own code computes when it is built: its ``__init__`` and transformers'
``_init_weights`` (run by ``post_init``). So, for a transformers model, the source of truth is a fresh
construction of the same class from the same config with every *parameter* on the meta device (no
parameter memory, no parameter initialisation) and every buffer real, on CPU: `fresh_buffers`. Its
buffers are matched to the model's by checkpoint key (wrapper segments removed), which also holds for
pipeline stages (pruned copies that keep the full model's names) and peft-wrapped models.

Buffers of modules the fresh model does not have (modules added after construction) fall back to a
registered initializer (`register_buffer_initializer`: a registry, data rather than model-family
branches) or to rebuilding that one module from its ``config``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from automodel_checkpoint.convert import built_class
from automodel_checkpoint.keys import DEFAULT_KEY_RULES, KeyRules, checkpoint_key
from automodel_modules import find_hf_model, unwrap

__all__ = [
    "BufferInitializer",
    "assign_buffer",
    "buffer_initializer_for",
    "fresh_buffers",
    "register_buffer_initializer",
    "reinitialize_non_persistent_buffers",
    "unrecomputable_buffers",
]

logger = logging.getLogger(__name__)

BufferInitializer = Callable[[nn.Module], Mapping[str, torch.Tensor]]
"""``fn(module) -> {buffer name: fresh value on CPU}`` for a module's non-persistent buffers."""

_REGISTRY: dict[type[nn.Module], BufferInitializer] = {}


def register_buffer_initializer(module_type: type[nn.Module], fn: BufferInitializer) -> None:
    """Register how to recompute the non-persistent buffers of ``module_type`` (and its subclasses).

    Only needed for modules a fresh construction of the model does not contain. Mutates the
    process-wide registry; a later registration for the same type replaces the earlier.
    """
    _REGISTRY[module_type] = fn


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with parameters on meta (free) and buffers on CPU."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


_FRESH: dict[tuple[type[nn.Module], str], dict[str, torch.Tensor]] = {}
_FRESH_KEPT = 4  # constructions cached (per model class and config)


def _fresh_construction(hf: nn.Module) -> dict[str, torch.Tensor]:
    config: Any = hf.config
    model_class = built_class(hf)
    key = (model_class, config.to_json_string(use_diff=False))
    if key not in _FRESH:
        with _parameters_on_meta():
            fresh = model_class(copy.deepcopy(config))
        while len(_FRESH) >= _FRESH_KEPT:
            _FRESH.pop(next(iter(_FRESH)))
        _FRESH[key] = {checkpoint_key(n): b for n, b in fresh.named_buffers() if b is not None}
    return _FRESH[key]


def fresh_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of a fresh construction of ``model``'s transformers model, by checkpoint key.

    The transformers model inside ``model`` (through peft, compile and DDP wrappers) is built again
    from its class and config with its parameters on meta; its buffers are what ``__init__`` and
    ``post_init`` (``_init_weights``) compute. Keys are checkpoint keys relative to that transformers
    model, so a pipeline stage or a wrapped model finds its buffers under the same keys. No collective;
    results are cached per class and config.

    Returns:
        Checkpoint key -> buffer (on CPU; shared with the cache: copy before writing into it), or ``{}``
        when ``model`` holds no transformers model.
    """
    _, hf = find_hf_model(unwrap(model))
    if not callable(getattr(getattr(hf, "config", None), "to_json_string", None)):
        return {}
    return _fresh_construction(hf)


def _rebuild_from_config(module: nn.Module) -> Mapping[str, torch.Tensor]:
    """Construct a fresh module of the same class from ``module.config``; return its buffers."""
    with _parameters_on_meta():
        fresh = type(module)(module.config)
    return {
        name: buf
        for name, buf in fresh._buffers.items()
        if buf is not None and name in fresh._non_persistent_buffers_set
    }


def _config_constructible(module: nn.Module) -> bool:
    if getattr(module, "config", None) is None:
        return False
    try:
        params = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    if not params or params[0].name != "config":
        return False
    return all(
        p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in params[1:]
    )


def buffer_initializer_for(module: nn.Module) -> BufferInitializer | None:
    """The fallback initializer for a module the fresh model does not contain, or None.

    A registered one (most derived type first) wins; else the module is rebuilt from its ``config``
    when its class is constructible from the config alone.
    """
    for cls in type(module).__mro__:
        fn = _REGISTRY.get(cls)
        if fn is not None:
            return fn
    return _rebuild_from_config if _config_constructible(module) else None


def assign_buffer(module: nn.Module, name: str, value: torch.Tensor, device: torch.device | None) -> None:
    """Replace ``module``'s buffer ``name`` by a copy of ``value``.

    The copy keeps the buffer's dtype when both are floating point, and goes to ``device``, else the
    buffer's device (CPU for a meta buffer).
    """
    current = module._buffers[name]
    assert current is not None
    target = device or (current.device if current.device.type != "meta" else torch.device("cpu"))
    dtype = current.dtype if current.dtype.is_floating_point == value.dtype.is_floating_point else value.dtype
    module._buffers[name] = value.to(device=target, dtype=dtype, copy=True)


def _non_persistent(model: nn.Module, only_meta: bool) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    return [
        (prefix, module, name, buf)
        for prefix, module in model.named_modules()
        for name, buf in module._buffers.items()
        if buf is not None
        and name in module._non_persistent_buffers_set
        and (not only_meta or buf.device.type == "meta")
    ]


def unrecomputable_buffers(model: nn.Module, rules: KeyRules = DEFAULT_KEY_RULES) -> list[str]:
    """The meta non-persistent buffers that `reinitialize_non_persistent_buffers` would find no value for.

    Reads the model only (and builds the fresh model of `fresh_buffers`); no collective.

    Returns:
        ``"<module fqn> (<class>: '<buffer>')"`` for each.
    """
    targets = _non_persistent(model, only_meta=True)
    fresh = fresh_buffers(model) if targets else {}
    stuck = []
    for prefix, module, name, buf in targets:
        value = fresh.get(checkpoint_key(f"{prefix}.{name}" if prefix else name, rules))
        if (value is None or value.shape != buf.shape) and buffer_initializer_for(module) is None:
            stuck.append(f"{prefix or '<root>'} ({type(module).__name__}: {name!r})")
    return stuck


def reinitialize_non_persistent_buffers(
    model: nn.Module,
    device: torch.device | str | None = None,
    *,
    only_meta: bool = False,
    rules: KeyRules = DEFAULT_KEY_RULES,
) -> list[str]:
    """Give every non-persistent buffer the value a fresh construction of the model computes.

    Sources, in order: `fresh_buffers` (the transformers model built again with parameters on meta),
    then `buffer_initializer_for` the owning module.

    Args:
        model: The model; its modules' ``_buffers`` are replaced (new tensors, same names).
        device: Where the buffers go; None keeps each buffer's device (CPU for a meta buffer).
        only_meta: Touch only buffers still on meta.
        rules: Name rewrites from model FQNs to checkpoint keys.

    Returns:
        FQNs of the buffers that were recomputed.

    Raises:
        ValueError: A meta non-persistent buffer has no source (names the modules and the fix).
    """
    dev = torch.device(device) if device is not None else None
    targets = _non_persistent(model, only_meta)
    if not targets:
        return []
    fresh = fresh_buffers(model)
    done: list[str] = []
    missing: list[str] = []
    fallback: dict[int, Mapping[str, torch.Tensor]] = {}
    for prefix, module, name, buf in targets:
        fqn = f"{prefix}.{name}" if prefix else name
        value = fresh.get(checkpoint_key(fqn, rules))
        if value is None or value.shape != buf.shape:
            if id(module) not in fallback:
                fn = buffer_initializer_for(module)
                fallback[id(module)] = fn(module) if fn is not None else {}
            value = fallback[id(module)].get(name)
        if value is None:
            if buf.device.type == "meta":
                missing.append(f"{prefix or '<root>'} ({type(module).__name__}: {name!r})")
            continue
        assign_buffer(module, name, value, dev)
        done.append(fqn)
    if missing:
        raise ValueError(
            f"cannot recompute non-persistent buffers of {missing}: a fresh construction of the model does "
            "not have them and their modules are not constructible from their config alone. Register an "
            "initializer with automodel_checkpoint.register_buffer_initializer(ModuleClass, fn)."
        )
    logger.debug("recomputed non-persistent buffers: %s", done)
    return done
