"""A captured micro-batch completed from the script's own call: a value the incident does not
hold (``incident.batches.Missing``: an object it cannot keep as data, a buffer refilled in place
before the capture) is taken from the same place in what the script passed, None where the script
passed nothing there. A replay fed so did not run on the step's own data, and says so."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._tree import holds
from ..incident.batches import Missing

_ABSENT = object()


def incomplete(batch: Any) -> bool:
    """Whether a captured batch lacks a value the step was fed."""
    return holds(batch, Missing)


def fill(captured: Any, own: Any = _ABSENT) -> Any:
    """``captured`` with each ``Missing`` replaced by what ``own`` holds at the same place: by
    index in a tuple or list, by key in a dict. A container of another kind (a namedtuple, a
    dataclass, a ``BatchEncoding``) that lacks a value is taken from the script whole."""
    if not incomplete(captured):
        return captured
    if type(captured) in (tuple, list):
        same = type(own) is type(captured) and len(own) == len(captured)
        return type(captured)(fill(item, own[i] if same else _ABSENT) for i, item in enumerate(captured))
    if type(captured) is dict:
        return {key: fill(value, own.get(key, _ABSENT) if isinstance(own, Mapping) else _ABSENT)
                for key, value in captured.items()}
    return None if own is _ABSENT else own
