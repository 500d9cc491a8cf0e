"""`ConfigDict`: the ``to_dict`` / ``from_dict`` every automodel config dataclass shares.

``to_dict`` returns the fields as a shallow dict (values are not copied; a subclass may rename keys or
convert values with `ConfigDict._dict_key` / `ConfigDict._dict_value`); ``from_dict`` builds the config
back, accepting the keys of `ConfigDict._dict_aliases` too, and raises `ValueError` naming an unknown key
and the known fields.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

__all__ = ["ConfigDict"]

_C = TypeVar("_C", bound="ConfigDict")


class ConfigDict:
    """Mixin for ``@dataclass`` configs: ``to_dict()`` and ``from_dict()``."""

    _dict_aliases: ClassVar[Mapping[str, str]] = {}
    """Other key -> field name, accepted by `from_dict` (e.g. the reference system's spelling)."""

    def _dict_key(self, name: str) -> str:
        """The key `to_dict` writes field ``name`` under (the field name itself by default)."""
        return name

    def _dict_value(self, name: str, value: Any) -> Any:
        """The value `to_dict` writes for field ``name`` (the value itself by default)."""
        del name
        return value

    def changed_fields(self, names: Iterable[str]) -> list[str]:
        """The fields of ``names`` whose value differs from the field's declared default."""
        fields = {f.name: f for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        changed = []
        for name in names:
            spec = fields[name]
            factory = spec.default_factory
            default = factory() if callable(factory) else spec.default
            if getattr(self, name) != default:
                changed.append(name)
        return changed

    def warn_unused(self, names: list[str], why: str, *, stacklevel: int = 4) -> None:
        """Warn that the fields ``names`` act on nothing, and ``why`` (no warning when ``names`` is empty).

        A setting that would act on nothing is never dropped silently. ``stacklevel`` 4 points at the
        caller of a dataclass constructor when called from ``__post_init__``.
        """
        if names:
            owner = type(self).__name__
            warnings.warn(f"{owner}.{f', {owner}.'.join(names)} ignored: {why}", stacklevel=stacklevel)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a shallow dict."""
        return {
            self._dict_key(f.name): self._dict_value(f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        }

    @classmethod
    def from_dict(cls: type[_C], data: Mapping[str, Any]) -> _C:
        """Build from a mapping (`to_dict`'s keys, field names or aliases).

        Raises:
            ValueError: An unknown key (naming it and the known fields), or one field given twice.
        """
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        unknown = []
        for key, value in data.items():
            name = cls._dict_aliases.get(key, key)
            if name not in known:
                unknown.append(key)
            elif name in kwargs:
                raise ValueError(f"{cls.__name__}.{name} is given twice (as {name!r} and an alias)")
            else:
                kwargs[name] = value
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__} field(s) {sorted(unknown)}; known fields: {sorted(known)}"
            )
        return cls(**kwargs)
