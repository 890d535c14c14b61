"""Nesting bounds for JSON and TOML values that come from a unit's flags or an operator's file.

Python's json and tomllib parsers recurse once per level, and so do json.dumps and every walk of
the value after them: a value nested a few thousand levels deep (`--hf-overrides '{"a":{"a":...'`,
a dotted `--hf-overrides.a.a.a...`, `x = [[[[...]]]]` in a TOML file) ends in RecursionError, which
the CLI could only report as an "unexpected error". No vLLM config nests more than a few levels, so
a value deeper than MAX_DEPTH is refused, before it is parsed where the text can be scanned.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class TooDeep(ValueError):
    """A JSON text or value nested deeper than MAX_DEPTH levels."""

    def __init__(self, limit: int = MAX_DEPTH) -> None:
        super().__init__(f"nested deeper than {limit} levels")


def json_text_depth_ok(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON TEXT nests no deeper than LIMIT: brackets counted outside strings, without
    parsing (so it never recurses); malformed text is left to the parser."""
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        if depth > limit:
            return False
    return True


def depth_ok(value: object, limit: int = MAX_DEPTH) -> bool:
    """Whether VALUE (dicts and lists) nests no deeper than LIMIT; iterative, so deep input cannot
    recurse."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return True


def loads(text: str, limit: int = MAX_DEPTH) -> Any:
    """json.loads, refused (TooDeep, a ValueError) where the text nests deeper than LIMIT."""
    if not json_text_depth_ok(text, limit):
        raise TooDeep(limit)
    try:
        return json.loads(text)
    except RecursionError:  # the scan and the parser disagree only on malformed text
        raise TooDeep(limit) from None
