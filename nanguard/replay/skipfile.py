"""The skip file: the ids of the samples a replay found bad, for the user's sampler on resume.

A replay whose sample search found bad samples with ids (``sample_id_key``) writes ``skip.json``
into the incident folder; ``nanguard.skip_list(path, ...)`` reads one or more of them (files or
incident folders) back as one set of ids::

    skip = nanguard.skip_list("nanguard-incidents/step25")
    indices = [i for i in range(len(dataset)) if i not in skip]

The file is data from disk: every field is checked before it is used, and nothing is unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import IncidentError
from ..incident.fsio import read_json

SKIP = "skip.json"
FORMAT = "nanguard-skip"
VERSION = 1
_MAX_BYTES = 64 << 20


def skip_record(incident: str, step: int, key: str, bad: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What skip.json holds, or None when no bad sample has an id. ``bad``: {"rank",
    "micro_batch", "index", "id"} per bad sample."""
    with_ids = [b for b in bad if b.get("id") is not None]
    if not with_ids:
        return None
    ids = sorted({b["id"] for b in with_ids}, key=lambda i: (isinstance(i, str), i))
    return {"format": FORMAT, "version": VERSION, "incident": incident, "step": step, "key": key,
            "ids": ids, "samples": with_ids}


def skip_list(*paths: str | os.PathLike) -> frozenset:
    """The sample ids of one or more skip files (a skip.json, or an incident folder holding one),
    as one set: pass it to your sampler on resume to leave those samples out."""
    if not paths:
        raise TypeError("nanguard.skip_list: give one or more skip files or incident folders")
    ids: set = set()
    for path in paths:
        ids |= set(_read(os.fspath(path))["ids"])
    return frozenset(ids)


def _read(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        folder, path = path, os.path.join(path, SKIP)
        if not os.path.isfile(path):
            raise IncidentError(path, f"missing: no replay of {folder} found bad samples with ids (replay.json"
                                      " says what its search found; name the key that holds sample ids with"
                                      " NANGUARD_SAMPLE_ID_KEY and replay again)")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise IncidentError(path, f"could not be read as a skip file ({exc})") from exc
    if size > _MAX_BYTES:
        raise IncidentError(path, f"is larger than {_MAX_BYTES >> 20} MiB: not a skip file nanguard wrote")
    data = read_json(path, "could not be read as a skip file", "nothing was read")
    problem = _problem(data)
    if problem is not None:
        raise IncidentError(path, f"is not a skip file nanguard wrote ({problem}); nothing was read")
    return data


def _problem(data: Any) -> str | None:
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        return f"its \"format\" is not {FORMAT!r}"
    if data.get("version") != VERSION:
        return f"version {data.get('version')!r}; this nanguard reads version {VERSION}"
    ids = data.get("ids")
    if not isinstance(ids, list) or not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids):
        return "\"ids\" is not a list of integers and strings"
    return None
