"""The one walker over nested containers: what a module returns, what a model is fed.

Containers are tuples (namedtuples and ``torch.Size`` included), lists, mappings (dicts,
``OrderedDict``, ``UserDict`` such as Hugging Face's ``BatchEncoding``, ``ModelOutput``) and
dataclass instances; anything else is a leaf. Nesting deeper than ``MAX_DEPTH`` is not entered.
Both functions see the same tensors of containers in the same order: what is checked is what is
captured. ``floating_tensors`` also looks into the attributes of other objects that hold tensors
(a ``torch.distributions.Normal`` a module returns), which a capture keeps only by name, except
transformers' key/value caches (``_key_value_cache`` says why).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import torch

MAX_DEPTH = 32
_LEAVES = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size})
"""types that never hold a tensor: a walk passes them without a call (module outputs are full of
None; ``torch.Size`` is a tuple of ints)"""


_SEQUENCE, _MAPPING, _DATACLASS, _OBJECT, _CLOSED = range(5)
_KINDS: dict[type, int] = {}
"""what each type met is, by type (an isinstance of an ABC, a dataclass test and a cache test cost
a few us each, at every container of every module call); bounded: a program has few types"""
_MAX_KINDS = 4096


def _kind(obj: Any) -> int:
    """What ``obj`` is to a walk: a sequence, a mapping, a dataclass instance, an object whose
    attributes may hold tensors, or one never looked into (a class, a module, a key/value cache).
    A container's own attributes are not its items: only an object's are looked at (``_held``)."""
    cls = type(obj)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = (_SEQUENCE if issubclass(cls, (list, tuple)) else _MAPPING if issubclass(cls, Mapping) else
                _CLOSED if issubclass(cls, (type, torch.nn.Module)) or _key_value_cache(cls) else
                _DATACLASS if dataclasses.is_dataclass(cls) else _OBJECT)
        if len(_KINDS) >= _MAX_KINDS:
            _KINDS.clear()
        _KINDS[cls] = kind
    return kind


def _items(obj: Any) -> Iterable[Any] | None:
    """The children of a container, or None for a leaf."""
    kind = _kind(obj)
    if kind == _SEQUENCE:
        return obj
    if kind == _MAPPING:
        return obj.values()
    if kind == _DATACLASS:
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def _held(obj: Any) -> Iterable[Any] | None:
    """The attributes of an object that are tensors or containers (not other objects, so that a
    walk never wanders through a model or a tokenizer), or None."""
    attributes = getattr(obj, "__dict__", None) if _kind(obj) == _OBJECT else None
    if not isinstance(attributes, dict):
        return None
    return [value for value in attributes.values() if isinstance(value, torch.Tensor) or (
        type(value) not in _LEAVES and _items(value) is not None)]


def _key_value_cache(cls: type) -> bool:
    """A transformers key/value cache type (``DynamicCache``, ``StaticCache``, their layers), which
    decoders hand to every layer and return, in training too (``use_cache`` defaults to True).
    It holds the keys and values the attention layers compute during the call: walked at every
    layer, it made each step's walk grow with the square of the depth and probed each layer's keys
    and values again (32 layers: 1.33 of plain instead of 1.25). A non-finite key or value reaches
    the attention's output, which is checked; one that reaches nothing (a masked position) harms
    nothing."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # never imported: no cache to meet
    kinds = tuple(k for k in (getattr(cache_utils, "Cache", None), getattr(cache_utils, "CacheLayerMixin", None))
                  if isinstance(k, type))
    return bool(kinds) and issubclass(cls, kinds)


def tensors(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in the containers of ``obj``, in order (what ``map_tensors`` maps)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = _items(obj) if _depth < MAX_DEPTH else None
    return [t for item in items or () for t in tensors(item, _depth + 1)]


def holds(obj: Any, kind: type, _depth: int = 0) -> bool:
    """Whether ``obj``, or an item in its containers, is a ``kind``."""
    if isinstance(obj, kind):
        return True
    items = _items(obj) if _depth < MAX_DEPTH else None
    return any(holds(item, kind, _depth + 1) for item in items or ())


def floating_tensors(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """The floating-point (and complex) tensors in ``obj``, in order."""
    if type(obj) is tuple and len(obj) == 1 and type(obj[0]) is torch.Tensor:  # a hook's common call
        return [obj[0]] if obj[0].is_floating_point() or obj[0].is_complex() else []
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() or obj.is_complex() else []
    items = (_items(obj) or _held(obj)) if _depth < MAX_DEPTH and type(obj) not in _LEAVES else None
    if items is None:
        return []
    found: list[torch.Tensor] = []
    for item in items:
        kind = type(item)
        if kind is torch.Tensor:  # the common items, without a call
            if item.is_floating_point() or item.is_complex():
                found.append(item)
        elif kind not in _LEAVES:
            found.extend(floating_tensors(item, _depth + 1))
    return found


def named_floating_tensors(obj: Any, _path: str = "", _depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """``floating_tensors`` with where each one is: a mapping's key ("loss"), a sequence's index
    ("[1]"), a dataclass's field, joined by "." ("past_key_values.[0]"); "" for ``obj`` itself."""
    if isinstance(obj, torch.Tensor):
        return [(_path, obj)] if obj.is_floating_point() or obj.is_complex() else []
    if _depth >= MAX_DEPTH:
        return []
    kind = _kind(obj)
    if kind == _SEQUENCE:
        named = [(f"[{i}]", item) for i, item in enumerate(obj)]
    elif kind == _MAPPING:
        named = [(str(key), value) for key, value in obj.items()]
    elif kind == _DATACLASS:
        named = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    else:
        named = [(key, value) for key, value in vars(obj).items()
                 if isinstance(value, torch.Tensor) or _items(value) is not None] if _held(obj) is not None else []
    found: list[tuple[str, torch.Tensor]] = []
    for name, item in named:
        found.extend(named_floating_tensors(item, f"{_path}.{name}" if _path else name, _depth + 1))
    return found


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], _memo: dict[int, Any] | None = None,
                _depth: int = 0) -> Any:
    """A copy of ``obj`` with every tensor replaced by ``fn(tensor)``, containers rebuilt with
    their own types; other leaves are returned as they are. A tensor met twice is mapped once,
    so aliasing survives (``torch.save`` keeps it)."""
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = fn(obj)
        return memo[id(obj)]
    if _depth >= MAX_DEPTH or _items(obj) is None:
        return obj

    def again(item: Any) -> Any:
        return map_tensors(item, fn, memo, _depth + 1)

    if isinstance(obj, tuple):
        items = [again(item) for item in obj]
        if type(obj) is tuple:
            return tuple(items)
        if hasattr(type(obj), "_fields"):  # namedtuple: its constructor takes the fields one by one
            return type(obj)(*items)
        return type(obj)(items)  # torch.Size, structseq (torch.return_types.*)
    if type(obj) is list:
        return [again(item) for item in obj]
    if type(obj) is dict:
        return {key: again(value) for key, value in obj.items()}
    if isinstance(obj, (list, MutableMapping)):
        # subclasses (OrderedDict, defaultdict, UserDict, BatchEncoding, ModelOutput, ...) may
        # need constructor arguments we do not know: copy the object, then replace its items
        new = copy.copy(obj)
        for key, value in (enumerate(obj) if isinstance(obj, list) else list(obj.items())):
            new[key] = again(value)
        return new
    if isinstance(obj, Mapping):
        return {key: again(value) for key, value in obj.items()}  # read-only: a plain dict
    new = copy.copy(obj)
    for f in dataclasses.fields(obj):
        # object.__setattr__ also works on frozen dataclasses
        object.__setattr__(new, f.name, again(getattr(obj, f.name)))
    return new
