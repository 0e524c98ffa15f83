"""Files of an incident: one way to write (atomically), one way to hash, one JSON form.

A file written here appears complete under its name or not at all, and is on disk (fsync'ed,
its folder too) before the call returns, so that a manifest listing it can be trusted.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch

from ..errors import IncidentError
from ..events import Event


def digest(path: str) -> dict[str, Any]:
    """Size and sha256 of a file, read in 1 MiB blocks (states can be many GB)."""
    sha = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            sha.update(view[:n])
            size += n
    return {"size": size, "sha256": sha.hexdigest()}


def fsync_dir(path: str) -> None:
    # A rename is durable only once the folder that holds the name is fsync'ed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # some network filesystems refuse it
            raise
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[BinaryIO], Any]) -> dict[str, Any]:
    """Writes a file through ``write(f)`` so that ``path`` appears complete or not at all.

    Temporary sibling, flush, fsync, rename over ``path``, fsync of the folder. Returns the
    file's size and sha256 as read back from disk.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")
    return digest(path)


def plain(obj: Any) -> Any:
    """A strict-JSON form of ``obj``: non-finite floats as "nan"/"inf"/"-inf" (as events do),
    tuples as lists, dataclasses and Events as objects, anything else unknown as its str()."""
    if isinstance(obj, Event):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(key): plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(item) for item in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def read_json(path: str, failed: str, damaged: str) -> Any:
    """The JSON in ``path``; IncidentError naming it, saying it ``failed`` ("is not valid JSON")
    and why, then ``damaged`` (what that means and what to do), when it cannot be read, is not
    JSON, or is nested too deep to decode."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except RecursionError as exc:
        raise IncidentError(path, f"{failed} (nested too deep); {damaged}") from exc
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise IncidentError(path, f"{failed} ({exc}); {damaged}") from exc


def write_json(path: str, obj: Any) -> dict[str, Any]:
    """``plain(obj)`` as strict JSON, atomically; returns the file's size and sha256."""
    text = json.dumps(plain(obj), indent=1, allow_nan=False) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode()))


def write_torch(path: str, obj: Any) -> dict[str, Any]:
    """``torch.save(obj)``, atomically; returns the file's size and sha256."""
    return atomic_write(path, lambda f: torch.save(obj, f))
