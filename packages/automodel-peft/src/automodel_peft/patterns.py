"""Target patterns as regular expressions: the two pattern forms of the reference system.

- a plain name (letters, digits, ``_`` and ``.`` only) matches a module whose name is it or ends with
  ``.`` + it: a leaf name such as ``"q_proj"`` or a dotted suffix such as ``"self_attn.q_proj"``;
- anything else is a wildcard / regular expression that must match the whole dotted name: ``*`` and
  ``.*`` match any characters, except that a ``.*`` right after a complete name segment (at the start of
  the pattern, after ``.segment`` or after a numeric index) means "this module or anything below it", so
  ``"*.layers.1.*"`` does not match ``layers.10``; the rest of the pattern is a Python regular
  expression (``"*.(q|v)_proj"``, ``"*.layers.[0-3].*"``, ``".*"``).

`PeftConfig` validates its patterns with them and hands peft the combined expression;
`automodel_peft.matching` resolves them on a model. Pure string functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["pattern_regex", "patterns_to_regex"]

_PLAIN = re.compile(r"[\w.]+")
_WILDCARD = re.compile(r"\.?\*")
_INDEX_END = re.compile(r"\.\d+$")


def pattern_regex(pattern: str) -> str:
    """The regular expression (for ``fullmatch`` on a full module name) of one target pattern.

    Raises:
        ValueError: The pattern is not a valid regular expression.
    """
    if _PLAIN.fullmatch(pattern):
        return rf"(?:.*\.)?{re.escape(pattern)}"  # a leaf name or dotted suffix, at any depth
    pieces: list[str] = []
    start = 0
    for wildcard in _WILDCARD.finditer(pattern):
        text = pattern[start : wildcard.start()]
        # ``.*`` after a whole segment keeps its dot as a separator: the segment itself or its children.
        whole_segment = bool(text) and (start == 0 or text.startswith(".") or bool(_INDEX_END.search(text)))
        pieces += [text, r"(?:\..*)?" if wildcard.group() == ".*" and whole_segment else ".*"]
        start = wildcard.end()
    pieces.append(pattern[start:])
    regex = "(?:" + "".join(pieces) + ")"
    try:
        re.compile(regex)
    except re.error as exc:
        raise ValueError(f"target pattern {pattern!r} is not a valid regular expression: {exc}") from None
    return regex


def patterns_to_regex(patterns: Iterable[str]) -> str:
    """One regex that full-matches exactly the names any of ``patterns`` matches (peft's string form)."""
    return "(?:" + "|".join(pattern_regex(p) for p in patterns) + ")"
