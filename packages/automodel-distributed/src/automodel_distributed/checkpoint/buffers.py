"""Recompute non-persistent buffers (rotary ``inv_freq``, ``original_inv_freq``, ...) after meta init.

Non-persistent buffers are in no checkpoint, so after ``to_empty`` they hold garbage. They are
recomputed by running the owning module's constructor again: a module that keeps its ``config`` and
whose class is built from ``config`` alone (every transformers rotary embedding, of every family) is
rebuilt on CPU with its parameters on meta, and its fresh non-persistent buffers are copied over. Modules
built otherwise get an initializer registered with `register_buffer_initializer` (a registry: data,
not model-family branches).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

__all__ = [
    "BufferInitializer",
    "buffer_initializer_for",
    "register_buffer_initializer",
    "reinitialize_non_persistent_buffers",
]

logger = logging.getLogger(__name__)

BufferInitializer = Callable[[nn.Module], Mapping[str, torch.Tensor]]
"""``fn(module) -> {buffer name: fresh value on CPU}`` for a module's non-persistent buffers."""

_REGISTRY: dict[type[nn.Module], BufferInitializer] = {}


def register_buffer_initializer(module_type: type[nn.Module], fn: BufferInitializer) -> None:
    """Register how to recompute the non-persistent buffers of ``module_type`` (and its subclasses).

    Mutates the process-wide registry; a later registration for the same type replaces the earlier.
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
    """The initializer for ``module``, or None if it has none.

    A registered one (most derived type first) wins; else the module is rebuilt from its ``config``
    when its class is constructible from the config alone.
    """
    for cls in type(module).__mro__:
        fn = _REGISTRY.get(cls)
        if fn is not None:
            return fn
    return _rebuild_from_config if _config_constructible(module) else None


def _assign(module: nn.Module, name: str, value: torch.Tensor, device: torch.device | None) -> None:
    current = module._buffers[name]
    assert current is not None
    target = device or (current.device if current.device.type != "meta" else torch.device("cpu"))
    dtype = current.dtype if current.dtype.is_floating_point == value.dtype.is_floating_point else value.dtype
    module._buffers[name] = value.to(device=target, dtype=dtype)


def reinitialize_non_persistent_buffers(
    model: nn.Module, device: torch.device | str | None = None, *, only_meta: bool = False
) -> list[str]:
    """Recompute the non-persistent buffers of every module that has an initializer.

    Args:
        model: The model; its modules' ``_buffers`` are replaced (new tensors, same names).
        device: Where the buffers go; None keeps each buffer's device (CPU for a meta buffer).
        only_meta: Touch only modules with a buffer still on meta.

    Returns:
        FQNs of the buffers that were recomputed.

    Raises:
        ValueError: A meta non-persistent buffer has no initializer (names the modules and the fix).
    """
    dev = torch.device(device) if device is not None else None
    done: list[str] = []
    missing: list[str] = []
    for prefix, module in model.named_modules():
        names = [
            n for n, b in module._buffers.items() if b is not None and n in module._non_persistent_buffers_set
        ]
        if not names:
            continue
        on_meta = [n for n in names if module._buffers[n].device.type == "meta"]
        if only_meta and not on_meta:
            continue
        fn = buffer_initializer_for(module)
        if fn is None:
            if on_meta:
                missing.append(f"{prefix or '<root>'} ({type(module).__name__}: {on_meta})")
            continue
        fresh = fn(module)
        for name in names:
            if name in fresh:
                _assign(module, name, fresh[name], dev)
                done.append(f"{prefix}.{name}" if prefix else name)
            elif module._buffers[name].device.type == "meta":
                missing.append(f"{prefix or '<root>'} ({type(module).__name__}: [{name!r}])")
    if missing:
        raise ValueError(
            f"cannot recompute non-persistent buffers of {missing}: their modules are not constructible "
            "from their config alone. Register an initializer with "
            "automodel_distributed.checkpoint.register_buffer_initializer(ModuleClass, fn)."
        )
    logger.debug("recomputed non-persistent buffers: %s", done)
    return done
