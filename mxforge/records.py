"""A stage result's fields as its JSON record: the part of every `as_dict` that is the result's own fields under
their own names (computed entries, renamed keys and nested records each `as_dict` adds itself)."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any


def fields_of(result: Any, *names: str) -> dict[str, Any]:
    """{name: result.name} for each of `names`, in that order (a report's keys keep their order); a path as its
    text."""
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(result, name)
        out[name] = str(value) if isinstance(value, PurePath) else value
    return out
