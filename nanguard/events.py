"""Event: one observation of a non-finite value or a warning sign, and the ring that keeps them.

Events are plain data: JSON-serialisable through ``to_dict``/``from_dict`` (non-finite floats
travel as the strings "nan", "inf", "-inf"), one line through ``str()``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError
from .protocol import KINDS, VERDICTS_IN_JOB, WARN_KINDS


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, bounded in depth and length: a value that came off
    the wire nested a thousand deep must not make repr() recurse (RecursionError)."""
    return _REPR.repr(value)


def json_float(value: float | None) -> float | str | None:
    """A float as JSON allows it: non-finite values become "nan", "inf" or "-inf"."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def read_float(value: Any, name: str) -> float | None:
    """The inverse of ``json_float``; raises ProtocolError naming ``name`` on anything else."""
    if value is None:
        return None
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits: JSON has it, no float holds it
            raise ProtocolError(f"event field {name} is an integer too large for a float") from None
    raise ProtocolError(f"event field {name}={shown(value)} is not a number")


def within(name: str, ancestor: str) -> bool:
    """Whether module ``name`` (an ``Event.layer``, a qualified name) is ``ancestor`` or inside it."""
    return not ancestor or name == ancestor or name.startswith(ancestor + ".")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


@dataclass(slots=True)
class Event:
    """Where and what: one non-finite tensor (or a gradient-norm warning) seen on one rank."""

    kind: str
    """forward | loss | check | backward | grad | buffer | grad_norm | spike"""
    rank: int
    step: int
    """0-based index of the optimizer step it happened in"""
    layer: str
    """qualified module or parameter name (wrappers such as DDP's ``module.`` stripped)"""
    module_type: str = ""
    micro_batch: int | None = None
    """which forward of the root module within the step (gradient accumulation), if known"""
    output_field: str | None = None
    """where in the module's output the value was, when the output is a container ("loss",
    "logits", "[1]")"""
    has_nan: bool = False
    has_inf: bool = False
    input_nonfinite: bool | None = None
    """True when the module's inputs were already non-finite (it passed the value on)"""
    output_nonfinite: bool | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    numel: int | None = None
    bad_count: int | None = None
    nan_count: int | None = None
    inf_count: int | None = None
    finite_min: float | None = None
    finite_max: float | None = None
    finite_mean: float | None = None
    first_index: tuple[int, ...] | None = None
    first_value: float | None = None
    grad_norm: float | None = None
    host: str = ""
    reproduced: bool | None = None
    """True: a re-run of the step from memory made the same value non-finite again; False: it did
    not (a transient); None: no re-run was possible"""
    verdict: str | None = None
    """the verdict inside the job (``protocol.VERDICTS_IN_JOB``: reproducible, device, transient), or None"""
    device: str = ""
    """the device the rank computes on ("cuda:3 GPU-<uuid>", "cpu"), or "" when not known"""
    time: float = 0.0
    message: str = ""
    """one clause of context (what the input told, what is suspected)"""
    extra: dict[str, Any] = field(default_factory=dict)
    """small kind-specific data (per-parameter norms of a spike, ...)"""

    def to_dict(self, *, compact: bool = False) -> dict[str, Any]:
        """JSON-ready fields; ``compact`` leaves out those that hold their default value (what
        the wire sends: half the bytes, and half the coordinator's parsing)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("finite_min", "finite_max", "finite_mean", "first_value", "grad_norm"):
            out[name] = json_float(out[name])
        for name in ("shape", "first_index"):
            if out[name] is not None:
                out[name] = list(out[name])
        out["extra"] = dict(self.extra)
        if compact:
            return {name: value for name, value in out.items()
                    if name not in _DEFAULTS or value != _DEFAULTS[name]}
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Event:
        """Rebuild an event from ``to_dict`` output; raises ProtocolError on anything else."""
        return cls(**event_values(data))

    def where(self) -> str:
        what = {
            "forward": "non-finite output in",
            "loss": "non-finite loss",
            "check": "non-finite value in",
            "backward": "non-finite gradient flowing into the output of",
            "grad": "non-finite gradient of",
            "buffer": "non-finite buffer",
            "grad_norm": "large gradient norm",
            "spike": "gradient norm spike",
        }[self.kind]
        if self.kind == "forward" and self.input_nonfinite:
            what = "non-finite input to"
        elif self.output_field is not None and self.kind == "loss":  # (a loss names no module after it)
            model = f"the model ({self.module_type})" if self.module_type else "the model"
            return f"non-finite loss ({self.output_field!r} in the output of {model}) {self._place()}"
        elif self.output_field is not None and self.kind not in ("grad_norm", "spike"):
            what = f"non-finite {self.output_field!r} in the output of"
        # the root module's own name is empty: "the model" rather than a gap
        name = self.layer or ("the model" if self.module_type else "")
        subject = "" if self.kind in ("loss", "grad_norm", "spike") else f" {name}"
        if self.module_type:
            subject += f" ({self.module_type})"
        return f"{what}{subject} {self._place()}"

    def _place(self) -> str:
        place = f"at step {self.step}, rank {self.rank}"
        return place if self.micro_batch is None else f"{place}, micro-batch {self.micro_batch}"

    def detail(self) -> str:
        if self.kind in WARN_KINDS:
            return self.message
        if self.shape == () and self.first_value is not None:
            text = f"the value is {self.first_value}"  # a 0-d tensor (a loss): no counts, no index
        elif self.numel is not None and self.bad_count is not None:
            counts = []
            if self.nan_count:
                counts.append(f"{self.nan_count} NaN")
            if self.inf_count:
                counts.append(f"{self.inf_count} Inf")
            text = f"{' and '.join(counts) or self.bad_count} of {self.numel}"
            if self.first_index is not None:
                text += f", first at {list(self.first_index)} ({self.first_value})"
            if self.finite_min is not None:
                text += (f"; finite values in [{_fmt(self.finite_min)}, {_fmt(self.finite_max)}]"
                         f", mean {_fmt(self.finite_mean)}")
            elif self.bad_count == self.numel:
                text += "; no finite values"
        else:
            # without the tensor, only its extremes are known
            text = "NaN" if self.has_nan else "Inf" if self.has_inf else "non-finite"
            if self.shape is not None:
                text += f" in a tensor of shape {list(self.shape)}"
        return text + (f"; {self.message}" if self.message else "")

    def __str__(self) -> str:
        return f"{self.where()}: {self.detail()}"


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Event))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Event) if f.default is not dataclasses.MISSING}
_DEFAULTS["extra"] = {}
_REQUIRED = ("kind", "rank", "step", "layer")
# what each checked field must hold; the others (flags, dtype, time) are taken as they come
_INT, _OPTIONAL_INT, _FLOAT, _STR, _INTS, _OBJECT, _OPTIONAL_STR, _OPTIONAL_BOOL, _VERDICT = range(9)
_CHECKS = {
    "rank": _INT, "step": _INT,
    **dict.fromkeys(("micro_batch", "numel", "bad_count", "nan_count", "inf_count"), _OPTIONAL_INT),
    **dict.fromkeys(("finite_min", "finite_max", "finite_mean", "first_value", "grad_norm"), _FLOAT),
    **dict.fromkeys(("layer", "module_type", "host", "device", "message"), _STR),
    "output_field": _OPTIONAL_STR, "reproduced": _OPTIONAL_BOOL, "verdict": _VERDICT,
    "shape": _INTS, "first_index": _INTS, "extra": _OBJECT,
}
_INT_TYPE = frozenset((int,))
_NONE = type(None)
# per check: (value types that can be valid, the exact types whose values need no look; None: all)
_TYPE_RULES = {
    _INT: ((int,), None), _OPTIONAL_INT: ((int, _NONE), None), _FLOAT: ((float, int, str, _NONE), (float, _NONE)),
    _STR: ((str,), None), _INTS: ((list, tuple, _NONE), (_NONE,)), _OBJECT: ((dict,), None),
    _OPTIONAL_STR: ((str, _NONE), None), _OPTIONAL_BOOL: ((bool, _NONE), (bool, _NONE)),
    _VERDICT: ((str, _NONE), (_NONE,)),
}


def _is_int(value: Any) -> bool:
    return value.__class__ is int or (isinstance(value, int) and not isinstance(value, bool))


def event_values(data: Any) -> dict[str, Any]:
    """Check ``to_dict`` output and return it as ``Event``'s keyword arguments (floats for
    "nan"/"inf", tuples for lists); raises ProtocolError on anything else.

    ``Event.from_dict`` is this plus the constructor; the coordinator, which needs no Event
    objects, validates with this alone (the constructor costs more than the checks).
    """
    # Most of the checks depend only on which fields are there and the types of their values;
    # for a (names, types) pair that can be valid, a few value checks are left to do.
    plan = _plan(tuple(data), tuple(map(type, data.values()))) if data.__class__ is dict else None
    if plan is None:
        return _checked_values(data)  # slowly, and saying what is wrong
    if data["kind"] not in KINDS:
        raise ProtocolError(f"event kind {shown(data['kind'])} is not one of {', '.join(KINDS)}")
    values = dict(data)
    for name, check in plan:
        values[name] = _check_value(check, name, data[name])
    return values


@functools.lru_cache(maxsize=1024)
def _plan(names: tuple[str, ...], types: tuple[type, ...]) -> tuple[tuple[str, int], ...] | None:
    """For events with these field names and value types: the fields whose values still need a
    look; None when such an event cannot be valid (or would need a closer look everywhere)."""
    if not _FIELD_NAMES.issuperset(names) or not all(name in names for name in _REQUIRED):
        return None
    plan = []
    for name, kind in zip(names, types):
        check = _CHECKS.get(name)
        if check is None:
            continue  # (a field no rule checks, such as the flags has_nan and has_inf: any value, as is)
        valid, settled = _TYPE_RULES[check]
        if not issubclass(kind, valid) or kind is bool and bool not in valid:  # (a bool is an int)
            return None
        if settled is not None and kind not in settled:
            plan.append((name, check))
    return tuple(plan)


def _check_value(check: int, name: str, value: Any) -> Any:
    """One field's value, checked (ProtocolError) and converted to what Event holds."""
    if check == _INT or check == _OPTIONAL_INT:
        if not _is_int(value) and (value is not None or check == _INT):
            raise ProtocolError(f"event field {name}={shown(value)} is not an integer")
    elif check == _FLOAT:
        if value.__class__ is not float and value is not None:
            return read_float(value, name)
    elif check == _STR or check == _OPTIONAL_STR:
        if not isinstance(value, str) and (value is not None or check == _STR):
            raise ProtocolError(f"event field {name}={shown(value)} is not a string")
    elif check == _OPTIONAL_BOOL:
        if value.__class__ is not bool and value is not None:  # 0 and 1 are not flags here
            raise ProtocolError(f"event field {name}={shown(value)} is not true, false or null")
    elif check == _VERDICT:
        if value is not None and (not isinstance(value, str) or value not in VERDICTS_IN_JOB):
            raise ProtocolError(f"event field {name}={shown(value)} is not one of "
                                f"{', '.join(VERDICTS_IN_JOB)} or null")
    elif check == _INTS:
        if value is not None:
            if not isinstance(value, (list, tuple)) or not _INT_TYPE.issuperset(map(type, value)):
                raise ProtocolError(f"event field {name}={shown(value)} is not a list of integers")
            return tuple(value)
    elif not isinstance(value, dict):
        raise ProtocolError(f"event field {name} is not an object")
    return value


def _checked_values(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ProtocolError(f"an event must be a JSON object, got {type(data).__name__}")
    if not _FIELD_NAMES.issuperset(data):
        unknown = set(data) - _FIELD_NAMES
        raise ProtocolError(f"event has unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    for required in _REQUIRED:
        if required not in data:
            raise ProtocolError(f"event is missing the field {required!r}")
    if data["kind"] not in KINDS:
        raise ProtocolError(f"event kind {shown(data['kind'])} is not one of {', '.join(KINDS)}")
    values = dict(data)
    for name, value in data.items():
        check = _CHECKS.get(name)
        if check is not None:
            values[name] = _check_value(check, name, value)
    return values


class RecentEvents:
    """A thread-safe ring of the most recent events; memory stays bounded however many arrive."""

    def __init__(self, capacity: int):
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.total = 0
        """events ever added, including those the ring has since forgotten"""

    def add(self, event: Event) -> None:
        with self._lock:
            self._ring.append(event)
            self.total += 1

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self._ring)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ring)
