"""Read a YAML job file into plain values, remembering the file line of every section and key.

Errors found later (an unknown key, a wrong type, a value a config rejects) can then say *where* the
offending setting was written: ``job.yaml:12: train.lr: expected a number, got 'fast'``. Command-line
options are recorded the same way, with the option's name as their origin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ConfigError", "RawJob", "load_yaml"]


class ConfigError(ValueError):
    """A user error in a job file or option; the message starts with where the setting came from."""


@dataclass
class RawJob:
    """Sections of plain values plus the origin (``file:line`` or ``--option``) of each setting."""

    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``section -> key -> value`` (values as YAML gives them: str, int, float, bool, list, dict)."""
    origins: dict[tuple[str, str | None], str] = field(default_factory=dict)
    """``(section, key)`` (key ``None`` for the section itself) -> where it was set."""

    def where(self, section: str, key: str | None = None) -> str:
        """The origin of ``section.key``, else of the section, else ``"defaults"``."""
        return self.origins.get((section, key)) or self.origins.get((section, None)) or "defaults"

    def set(self, section: str, key: str, value: Any, origin: str) -> None:
        """Set one value (a command-line override), recording its origin."""
        self.sections.setdefault(section, {})[key] = value
        self.origins.setdefault((section, None), origin)
        self.origins[(section, key)] = origin

    def to_plain(self) -> dict[str, dict[str, Any]]:
        """The sections as a JSON-serialisable dict (how workers receive the job)."""
        return {name: dict(values) for name, values in self.sections.items()}


def _line(node: yaml.Node, filename: str) -> str:
    return f"{filename}:{node.start_mark.line + 1}"


def load_yaml(path: str | Path) -> RawJob:
    """Parse ``path``: a mapping of sections, each a mapping of keys to values (or empty).

    Raises:
        ConfigError: The file is missing or not YAML, the top level or a section is not a mapping, or a
            key appears twice (YAML would silently keep the last one).
    """
    file = Path(path)
    name = str(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the job file ({exc.strerror})") from None
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        raw = RawJob()
        if root is None:
            return raw
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(f"{_line(root, name)}: the job file must be a mapping of sections (name: ...)")
        for key_node, value_node in root.value:
            section = str(loader.construct_object(key_node))
            if section in raw.sections:
                raise ConfigError(f"{_line(key_node, name)}: section '{section}' appears twice")
            raw.origins[(section, None)] = _line(key_node, name)
            raw.sections[section] = {}
            if isinstance(value_node, yaml.ScalarNode) and value_node.tag == "tag:yaml.org,2002:null":
                continue  # "peft:" with nothing under it: the section with its defaults
            if not isinstance(value_node, yaml.MappingNode):
                raise ConfigError(
                    f"{_line(value_node, name)}: section '{section}' must be a mapping of keys "
                    f"(key: value), got {loader.construct_object(value_node, deep=True)!r}"
                )
            for sub_key, sub_value in value_node.value:
                key = str(loader.construct_object(sub_key))
                if key in raw.sections[section]:
                    raise ConfigError(f"{_line(sub_key, name)}: {section}.{key} appears twice")
                raw.origins[(section, key)] = _line(sub_key, name)
                raw.sections[section][key] = loader.construct_object(sub_value, deep=True)
        return raw
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark is not None else name
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    finally:
        loader.dispose()
