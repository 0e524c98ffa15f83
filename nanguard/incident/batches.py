"""The step's batches on disk as data only: ``torch.load(weights_only=True)`` reads them back.

An incident folder may come from anywhere (a teammate, a bug report), and unpickling runs code,
so batches are not pickled. Tensors (moved to the CPU), numbers, strings, bytes and None are kept
as they are; tuples, lists and dicts of them too. Other containers (namedtuples, dataclasses,
``UserDict`` such as Hugging Face's ``BatchEncoding``, ``ModelOutput``, ``OrderedDict``) become a
tagged dict holding their class's name and their contents; numpy arrays become tensors. Anything
else cannot be kept as data: it is recorded by type and ``repr`` only, and a replay says so.

Reading back never imports a module nor calls a constructor: a class is looked up only among the
modules the replaying script has already imported, only when it is a container of the kind the tag
says, and its instance is built from its builtin base (``tuple.__new__``, ``dict.__new__``,
``object.__new__``) with the saved contents set directly. A class that cannot be found that way is
replaced by its plain equivalent (tuple, dict), and a note says which.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from .._tree import MAX_DEPTH

TAG = "__nanguard__"
_ATOMS = (str, int, float, bool, bytes, type(None))
_KEPT = (torch.dtype, torch.device, torch.Size)  # what weights_only loading knows besides atoms


class Changed:
    """In place of a batch tensor changed in place after its forward (a static input buffer
    refilled for the next micro-batch): what it holds now is not what the step was fed, so it
    is written as unsupported, and a replay feeds the script's own tensor and says why."""

    __slots__ = ("shape", "dtype")

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def encoded(self) -> dict[str, Any]:
        return _unsupported("torch.Tensor", f"{str(self.dtype).removeprefix('torch.')} of shape {list(self.shape)}",
                            "changed in place after its forward, as a static input buffer refilled for"
                            " the next micro-batch is: what it held when the step was fed is lost")


class Missing:
    """Read back in place of a value the incident does not hold (written as unsupported): a replay
    feeds the script's own value at that place (``replay.fill``)."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<not in the incident: {self.what}>"


def encode(obj: Any, _memo: dict[int, torch.Tensor] | None = None, _depth: int = 0) -> Any:
    """``obj`` as data a weights_only load accepts (tensors detached, local shards, on the CPU;
    a tensor met twice is copied once, so the file keeps the aliasing)."""
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            tensor = obj.detach()
            to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's shard
            memo[id(obj)] = (to_local() if to_local is not None else tensor).to("cpu", copy=True)
        return memo[id(obj)]
    if type(obj) in _ATOMS or isinstance(obj, _KEPT):
        return obj
    if type(obj) is Changed:
        return obj.encoded()
    if _depth >= MAX_DEPTH:
        return _unsupported_object(obj, "nested too deep")
    again = (lambda item: encode(item, memo, _depth + 1))
    if type(obj) in (tuple, list):
        return type(obj)(again(item) for item in obj)
    if type(obj) is dict and TAG not in obj and all(type(k) in _ATOMS for k in obj):
        return {key: again(value) for key, value in obj.items()}
    if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
        return {TAG: "ndarray", "tensor": torch.from_numpy(obj.copy())}
    name = f"{type(obj).__module__}:{type(obj).__qualname__}"
    if isinstance(obj, tuple):
        return {TAG: "tuple", "type": name, "items": [again(item) for item in obj]}
    if isinstance(obj, list):
        return {TAG: "list", "type": name, "items": [again(item) for item in obj]}
    if isinstance(obj, Mapping):
        return {TAG: "mapping", "type": name, "keys": [again(k) for k in obj.keys()],
                "values": [again(v) for v in obj.values()], "state": again(dict(getattr(obj, "__dict__", {})))}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {TAG: "dataclass", "type": name,
                "fields": {f.name: again(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    return _unsupported_object(obj, "not a container or a value nanguard can keep as data")


def _unsupported_object(obj: Any, why: str) -> dict[str, Any]:
    return _unsupported(f"{type(obj).__module__}.{type(obj).__qualname__}", repr(obj)[:200], why)


def _unsupported(kind: str, shown: str, why: str) -> dict[str, Any]:
    """What is written in place of a value an incident does not keep: its type, how it looked, why."""
    return {TAG: "unsupported", "type": kind, "repr": shown, "why": why}


def decode(data: Any, notes: list[str], _depth: int = 0) -> Any:
    """The batch ``encode`` wrote, with its containers' classes where the script knows them; what
    cannot be rebuilt faithfully is said in ``notes``. Raises ValueError on data ``encode`` could
    not have written (the folder is damaged or crafted)."""
    if _depth > MAX_DEPTH + 1:
        raise ValueError("nested deeper than any batch nanguard writes")
    again = (lambda item: decode(item, notes, _depth + 1))
    if isinstance(data, (tuple, list)):
        return type(data)(again(item) for item in data)
    if not isinstance(data, dict):
        return data
    tag = data.get(TAG)
    if tag is None:
        return {key: again(value) for key, value in data.items()}
    if tag == "ndarray":
        return _field(data, "tensor", torch.Tensor).numpy()
    if tag == "unsupported":
        why, what = data.get("why"), f"a {_field(data, 'type', str)} ({_field(data, 'repr', str)})"
        notes.append(f"the captured batch held {what}, which an incident does not keep"
                     f"{f' ({why})' if isinstance(why, str) else ''}; the replay fed the script's own value"
                     " at that place (None where the script had none)")
        return Missing(what)
    rebuild = _REBUILD.get(tag)
    if rebuild is None:
        raise ValueError(f"unknown batch tag {tag!r}")
    return rebuild(data, again, notes)


def _build(cls: type | None, make, plain, notes: list[str]) -> Any:
    """``make(cls)``; the plain value where the class is unknown or will not be built that way
    (a C type such as a structseq refuses ``tuple.__new__``)."""
    if cls is None:
        return plain
    try:
        return make(cls)
    except (TypeError, AttributeError):  # AttributeError: saved state for instances that have no __dict__
        notes.append(f"the captured batch held a {cls.__module__}.{cls.__qualname__}, which cannot be"
                     f" rebuilt from its contents alone; it was fed as a plain {type(plain).__name__}")
        return plain


def _field(data: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"batch entry {data.get(TAG)!r} has no valid {key!r}")
    return value


def _known_class(name: str, base: type, notes: list[str], fallback: str) -> type | None:
    """The class ``module:qualname`` when the script already imported its module and it is a
    subclass of ``base``; else None, and a note that the plain ``fallback`` is fed instead."""
    module_name, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    if isinstance(obj, type) and issubclass(obj, base):
        return obj
    notes.append(f"the captured batch held a {name.replace(':', '.')}, which this script has not imported"
                 f" (or which is not a {base.__name__}); it was fed as a plain {fallback}")
    return None


def _tuple(data: dict, again, notes: list[str]) -> tuple:
    items = tuple(again(item) for item in _field(data, "items", list))
    cls = _known_class(_field(data, "type", str), tuple, notes, "tuple")
    return _build(cls, lambda c: tuple.__new__(c, items), items, notes)


def _list(data: dict, again, notes: list[str]) -> list:
    items = [again(item) for item in _field(data, "items", list)]

    def make(cls: type) -> list:
        new = list.__new__(cls)
        list.extend(new, items)
        return new

    return _build(_known_class(_field(data, "type", str), list, notes, "list"), make, items, notes)


def _mapping(data: dict, again, notes: list[str]) -> Mapping:
    keys, values = _field(data, "keys", list), _field(data, "values", list)
    if len(keys) != len(values):
        raise ValueError("batch mapping has as many keys as values")
    items = {again(k): again(v) for k, v in zip(keys, values)}
    state = again(_field(data, "state", dict))

    def make(cls: type) -> Mapping:
        # the builtin base builds and fills it: the class's own methods never run
        base = next((b for b in (OrderedDict, dict) if issubclass(cls, b)), object)
        new = base.__new__(cls)
        new.__dict__.update(state)  # a UserDict keeps its items here ("data"), a ModelOutput its fields
        for key, value in items.items() if base is not object else ():
            base.__setitem__(new, key, value)
        try:  # its own methods read it now, as the replayed forward will: crafted state can break them
            whole = len(new) == len(items) and all(key in new for key in items)
        except Exception:  # noqa: BLE001 (any failure of the class's code on that state)
            whole = False
        if not whole:
            raise TypeError("its items do not read back as written")
        return new

    return _build(_known_class(_field(data, "type", str), Mapping, notes, "dict"), make, items, notes)


def _dataclass(data: dict, again, notes: list[str]) -> Any:
    fields = {name: again(value) for name, value in _field(data, "fields", dict).items()}
    cls = _known_class(_field(data, "type", str), object, notes, "dict")
    if cls is None or not dataclasses.is_dataclass(cls) or {f.name for f in dataclasses.fields(cls)} != set(fields):
        if cls is not None:
            notes.append(f"{data['type']} no longer has the captured fields; it was fed as a plain dict")
        return fields

    def make(cls: type) -> Any:
        new = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(new, name, value)
        return new

    return _build(cls, make, fields, notes)


_REBUILD = {"tuple": _tuple, "list": _list, "mapping": _mapping, "dataclass": _dataclass}
