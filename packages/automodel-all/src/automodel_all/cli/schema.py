"""Check and convert plain YAML values against a config dataclass's field types.

YAML gives strings, numbers, booleans, lists and mappings. The component configs want Python types:
``torch.dtype`` (written ``bfloat16``), ``MixedPrecisionPolicy`` (written as a mapping of its fields),
nested dataclasses, unions and literals. `build_dataclass` converts each key of a section, raising
`ConfigError` that names the key and where it was set when a key is unknown or a value has the wrong
type, and re-raises a config's own ``ValueError`` with the same location.
"""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import difflib
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from automodel_all.cli.yaml_source import ConfigError, RawJob

__all__ = ["build_dataclass", "field_names"]

_T = TypeVar("_T")


class _Mismatch(Exception):
    """A value does not fit an annotation; the message says what was expected."""


def field_names(cls: type[Any]) -> list[str]:
    """The init fields of a config dataclass (the keys its YAML section accepts)."""
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


_HINTS: dict[type[Any], dict[str, Any]] = {}
"""`_type_hints` per class (read-only to callers): ``automodel plan --suggest`` builds a job per layout
it tries, hundreds on a large cluster, and resolving the annotations was most of a build."""


def _type_hints(cls: type[Any]) -> dict[str, Any]:
    """Resolved field annotations, kept in `_HINTS`."""
    if cls not in _HINTS:
        _HINTS[cls] = _resolved_hints(cls)
    return _HINTS[cls]


def _resolved_hints(cls: type[Any]) -> dict[str, Any]:
    """Resolved field annotations; names imported only for type checking are supplied here."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    module = sys.modules.get(cls.__module__)
    namespace = dict(vars(module)) if module is not None else {}
    namespace.setdefault("MixedPrecisionPolicy", MixedPrecisionPolicy)
    namespace.setdefault("OffloadPolicy", OffloadPolicy)
    namespace.setdefault("torch", torch)
    try:
        # As locals: each base class's annotations still resolve in its own module (a config mixin's).
        return typing.get_type_hints(cls, localns=namespace)
    except Exception:  # an annotation we cannot resolve: the config's own validation still runs
        return {}


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any value"
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin in (list, cabc.Sequence, tuple):
        return "a list"
    if origin in (dict, cabc.Mapping):
        return "a mapping"
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    if annotation in names:
        return names[annotation]
    if annotation is torch.dtype:
        return "a dtype name (float32, bfloat16, float16)"
    if isinstance(annotation, type):
        return f"a mapping of {annotation.__name__} fields"
    return str(annotation)


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, str):
        candidate = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise _Mismatch


def _mapping_to_class(value: Any, cls: type[Any]) -> Any:
    """Objects that YAML writes as a mapping of constructor arguments."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    if not isinstance(value, Mapping):
        raise _Mismatch
    if cls is MixedPrecisionPolicy:
        allowed = {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise _Mismatch(f"unknown MixedPrecisionPolicy key(s) {unknown}; known: {sorted(allowed)}")
        kwargs: dict[str, Any] = {
            k: (_dtype(v) if k != "cast_forward_inputs" and v is not None else v) for k, v in value.items()
        }
        return MixedPrecisionPolicy(**kwargs)
    if cls is OffloadPolicy:
        unknown = sorted(set(value) - {"pin_memory"})
        if unknown:
            raise _Mismatch(f"unknown CPUOffloadPolicy key(s) {unknown}; known: ['pin_memory']")
        return CPUOffloadPolicy(**dict(value))
    if dataclasses.is_dataclass(cls):
        hints = _type_hints(cls)
        kwargs = {}
        for key, item in value.items():
            if key not in field_names(cls):
                raise _Mismatch(f"unknown {cls.__name__} key {key!r}; known: {field_names(cls)}")
            kwargs[key] = _convert(item, hints.get(key, Any))
        return cls(**kwargs)
    raise _Mismatch


def _convert(value: Any, annotation: Any) -> Any:
    """``value`` converted to fit ``annotation``; raises `_Mismatch` when it cannot."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any or annotation is object:
        return value
    if annotation is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            try:
                return _convert(value, arm)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is typing.Literal:
        if value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args)):
            return value
        raise _Mismatch
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if annotation is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if annotation is torch.dtype:
        return _dtype(value)
    if origin in (list, cabc.Sequence, tuple):
        if not isinstance(value, list | tuple):
            raise _Mismatch
        inner = args[0] if args else Any
        items = [_convert(item, inner) for item in value]
        return tuple(items) if origin is tuple else items
    if origin in (dict, cabc.Mapping):
        if not isinstance(value, Mapping):
            raise _Mismatch
        return dict(value)
    if origin is cabc.Callable or annotation is Callable:
        raise _Mismatch("a function cannot be set from YAML; pass it in Python")
    if isinstance(annotation, type):
        if isinstance(value, annotation):
            return value
        return _mapping_to_class(value, annotation)
    return value


def _field_of_message(message: str, keys: list[str]) -> str | None:
    """The key a config's error message is about (the longest key it names), if any."""
    named = [k for k in keys if f".{k}" in message or f"{k}=" in message or f"'{k}'" in message]
    return max(named, key=len) if named else None


def build_dataclass(
    cls: type[_T],
    raw: RawJob,
    section: str,
    *,
    values: Mapping[str, Any] | None = None,
    skip: tuple[str, ...] = (),
) -> _T:
    """Build ``cls`` from ``raw.sections[section]`` (or ``values``), checking every key first.

    Args:
        cls: The config dataclass the section maps onto.
        raw: The job (values and their origins).
        section: The section's name (for messages and origins).
        values: The keys to use instead of the whole section.
        skip: Keys of the section that are not fields of ``cls`` (handled by the caller).

    Raises:
        ConfigError: An unknown key or a wrong type (naming the key and where it was set), or the
            config's own ``ValueError`` (with the location of the key it names).
    """
    data = dict(raw.sections.get(section, {}) if values is None else values)
    known = field_names(cls)
    hints = _type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in skip:
            continue
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{raw.where(section, key)}: unknown key '{key}' in section '{section}'{hint}; "
                f"{cls.__name__} has: {', '.join(known)}"
            )
        annotation = hints.get(key, Any)
        try:
            kwargs[key] = _convert(value, annotation)
        except _Mismatch as exc:
            detail = f" ({exc})" if str(exc) else ""
            raise ConfigError(
                f"{raw.where(section, key)}: {section}.{key}: expected {_describe(annotation)}, got "
                f"{value!r} ({type(value).__name__}){detail}"
            ) from None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        named = _field_of_message(str(exc), list(kwargs))
        raise ConfigError(f"{raw.where(section, named)}: {section}: {exc}") from None
