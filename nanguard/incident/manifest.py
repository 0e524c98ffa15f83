"""The incident format: its names, the manifest that marks a complete incident, and every rule
a manifest and a rank record must follow.

Layout (``FORMAT_VERSION`` 2)::

    <root>/<incident>/manifest.json      written last, by one rank, once every rank is done
    <root>/<incident>/replay.json        the replay report, once a replay has run
    <root>/<incident>/rank<k>/state.pt   {"model": ..., "optimizer": ..., "extra": {"scaler": ..., "non_persistent_buffers": ...}}
                              batches.pt  [{"args": ..., "kwargs": ...}, ...] (absent without capture_batch)
                              rng.pt      rng_snapshot() from the start of the step
                              events.json [Event.to_dict(), ...]
                              environment.json
                              flight.json  the flight recorder (optional: older incidents have none)

The manifest lists every file with its size and sha256; nothing a manifest names is read before
all of its structure has been checked, and only the file names above may appear in it, so a
damaged or hostile manifest cannot make a reader look outside the incident; a file or a rank folder
that is a link leading out of the incident is refused (``inside``).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from typing import Any

from ..errors import IncidentError, ProtocolError
from ..events import Event
from .fsio import digest, plain

FORMAT = "nanguard-incident"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""1: batches.pt pickled (no longer loaded); 2: batches.pt as data (incident/batches.py)"""
MANIFEST = "manifest.json"
REPLAY = "replay.json"
VERDICTS = ("reproducible", "not_reproducible")

STATE, BATCHES, RNG = "state.pt", "batches.pt", "rng.pt"
EVENTS, ENVIRONMENT, FLIGHT = "events.json", "environment.json", "flight.json"
RANK_FILES = (STATE, BATCHES, RNG, EVENTS, ENVIRONMENT, FLIGHT)
REQUIRED_FILES = (STATE, RNG, EVENTS, ENVIRONMENT)  # batches.pt only with capture_batch; flight.json optional

_SHA256 = re.compile(r"[0-9a-f]{64}")
_TAMPERED = "tampered or truncated; nothing was loaded (copy the incident again from where it was written)"
_FIELD_TYPES = {"incident": str, "step": int, "world_size": int, "first_event": dict, "ranks": list,
                "capture_batch": bool, "sharded": (str, type(None)), "replay": (dict, type(None)),
                "notes": (dict, type(None))}


def rank_folder(rank: int) -> str:
    """The name of rank ``rank``'s folder in an incident."""
    return f"rank{rank}"


def build_manifest(incident_dir: str, *, world_size: int, step: int, first_event: Event | Mapping[str, Any],
                   rank_records: list[Mapping[str, Any]], capture_batch: bool, sharded: str | None,
                   notes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of the incident in ``incident_dir``, not yet checked nor written."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "incident": os.path.basename(os.path.normpath(incident_dir)),
        "step": step,
        "world_size": world_size,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "first_event": plain(first_event),  # an Event or its to_dict()
        "ranks": sorted((dict(r) for r in rank_records), key=lambda r: r.get("rank", -1)),
        "capture_batch": capture_batch,
        "sharded": sharded,
        "notes": {str(key): str(value) for key, value in (notes or {}).items()},  # (text: what a reader takes)
        "replay": None,
    }


def inside(incident_dir: str, path: str) -> None:
    """IncidentError when ``path``, its links followed, lies outside the incident folder (a link
    planted in a copied or crafted folder): a reader never looks outside the incident."""
    base = os.path.realpath(incident_dir)
    real = os.path.realpath(path)
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        raise IncidentError(path, f"is a link to {real!r}, outside the incident folder; the folder was damaged "
                                  "or crafted, and nanguard reads nothing outside it: nothing was loaded "
                                  "(copy the incident again, without links)")


def valid_entry(entry: Any) -> bool:
    """Whether a manifest's entry for a file gives its size and sha256."""
    return (isinstance(entry, Mapping) and type(entry.get("size")) is int and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"]) is not None)


def verify_file(incident_dir: str, relpath: str, expected: Mapping[str, Any], *, hashes: bool) -> None:
    """Checks that a listed file is on disk, inside the incident, with its listed size (and
    sha256, with ``hashes``)."""
    path = os.path.join(incident_dir, relpath)
    inside(incident_dir, path)
    if not os.path.isfile(path):
        raise IncidentError(path, "missing: listed in the manifest but not on disk (deleted, or the incident "
                                  "was copied in part); copy the whole folder again")
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise IncidentError(path, f"is {size} bytes, the manifest says {expected['size']}: {_TAMPERED}")
    if hashes:
        actual = digest(path)["sha256"]
        if actual != expected["sha256"]:
            raise IncidentError(path, f"sha256 {actual[:12]}... differs from the manifest's "
                                      f"{expected['sha256'][:12]}...: {_TAMPERED}")


def _check_record(manifest_path: str, record: Any, rank: int, capture_batch: bool) -> dict[str, Any]:
    def bad(why: str) -> IncidentError:
        return IncidentError(manifest_path, f"rank {rank}'s record {why}; the manifest is damaged or was "
                                            "written by other software")

    if not isinstance(record, Mapping) or not isinstance(record.get("files"), Mapping):
        raise bad("is not an object with 'files'")
    files = record["files"]
    folder = rank_folder(rank)
    allowed = {f"{folder}/{name}" for name in RANK_FILES}
    for relpath, entry in files.items():
        # only our own file names: a manifest must not make us read outside the incident
        if relpath not in allowed:
            raise bad(f"lists an unexpected file {relpath!r}")
        if not valid_entry(entry):
            raise bad(f"has no valid size and sha256 for {relpath}")
    required = REQUIRED_FILES + ((BATCHES,) if capture_batch else ())
    for name in required:
        if f"{folder}/{name}" not in files:
            raise bad(f"lacks {name}")
    if not capture_batch and f"{folder}/{BATCHES}" in files:
        raise bad("lists batches.pt although capture_batch is false (the batch was not meant to be on disk)")
    return dict(files)


def _check_structure(path: str, manifest: Any) -> list[dict[str, Any]]:
    """Every rule of a manifest that needs no disk; returns each rank's files, by rank."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IncidentError(path, f"is not a nanguard incident manifest (its \"format\" is not {FORMAT!r})")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        hint = ("upgrade nanguard to read it" if isinstance(version, int) and version > FORMAT_VERSION
                else "it was not written by a released nanguard")
        raise IncidentError(path, f"format version {version!r} is not supported (this nanguard reads versions "
                                  f"{', '.join(map(str, READABLE_VERSIONS))}); {hint}")
    for key, kind in _FIELD_TYPES.items():
        if not isinstance(manifest.get(key), kind) or (kind is int and isinstance(manifest[key], bool)):
            raise IncidentError(path, f"field {key!r} is missing or has the wrong type; "
                                      "the manifest is damaged")
    if manifest["step"] < 0:
        raise IncidentError(path, f"field 'step' is {manifest['step']}, not a step number; the manifest is damaged")
    world_size = manifest["world_size"]
    ranks = [r.get("rank") if isinstance(r, Mapping) else None for r in manifest["ranks"]]
    # the lengths first: a huge world size must not build its list of ranks
    if (world_size < 1 or len(ranks) != world_size or any(type(r) is not int for r in ranks)
            or ranks != list(range(world_size))):
        raise IncidentError(path, f"lists ranks {ranks} for a world size of {world_size}; every rank must "
                                  "appear once (did a rank's record not reach rank 0?)")
    try:
        Event.from_dict(manifest["first_event"])
    except ProtocolError as exc:
        raise IncidentError(path, f"first_event is not a valid event ({exc})") from exc
    records = [_check_record(path, record, k, manifest["capture_batch"])
               for k, record in enumerate(manifest["ranks"])]
    notes = manifest["notes"]
    if notes is not None and not all(isinstance(key, str) and isinstance(value, str) for key, value in notes.items()):
        raise IncidentError(path, "field 'notes' does not map names to text; the manifest is damaged")
    replay = manifest["replay"]
    if replay is not None and (replay.get("file") != REPLAY or replay.get("verdict") not in VERDICTS):
        raise IncidentError(path, "field 'replay' does not point at replay.json with a known verdict; "
                                  "the manifest is damaged")
    if replay is not None and not valid_entry(replay):
        raise IncidentError(path, f"field 'replay' has no valid size and sha256 for {REPLAY}; "
                                  "the manifest is damaged or was written by other software")
    return records


def check_manifest(incident_dir: str, manifest: Any, *, hashes: bool) -> None:
    """Every structural rule of a manifest, then every listed file on disk; raises IncidentError."""
    records = _check_structure(os.path.join(incident_dir, MANIFEST), manifest)
    # all structure first, then the disk: nothing is read before the manifest is known to be sane
    for k, files in enumerate(records):
        rank_dir = os.path.join(incident_dir, rank_folder(k))
        inside(incident_dir, rank_dir)
        if not os.path.isdir(rank_dir):
            raise IncidentError(rank_dir, f"missing: the manifest lists rank {k} but its folder is not there "
                                          "(deleted, or the incident was copied in part)")
        for relpath, entry in files.items():
            verify_file(incident_dir, relpath, entry, hashes=hashes)
    if manifest["replay"] is not None:
        verify_file(incident_dir, REPLAY, manifest["replay"], hashes=hashes)
