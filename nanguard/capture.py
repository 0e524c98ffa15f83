"""Write and read an incident folder: every rank's state from before the bad update.

Layout (``FORMAT_VERSION`` 1)::

    <root>/<incident>/manifest.json      written last, by one rank, once every rank is done
    <root>/<incident>/replay.json        the replay report, once a replay has run
    <root>/<incident>/rank<k>/state.pt   {"model": ..., "optimizer": ..., "extra": {"scaler": ...}}
                              batches.pt  [{"args": ..., "kwargs": ...}, ...] (absent without capture_batch)
                              rng.pt      rng_snapshot() from the start of the step
                              events.json [Event.to_dict(), ...]
                              environment.json

Why it is safe to trust a folder that has a manifest: each rank writes into a hidden temporary
folder and renames it to ``rank<k>`` only once every file in it is on disk (fsync'ed); the
manifest, which lists every file with its size and sha256, is written after all of them. A
crash or kill at any point therefore leaves either a folder without ``manifest.json`` (which
``read_incident`` reports as incomplete) or a complete incident, never one that looks complete
and is not.

Only storage lives here: no hooks and no ``torch.distributed`` calls. The caller (the guard)
chooses the folder name on rank 0, broadcasts it, has every rank call ``write_rank``, gathers
the rank records and calls ``finalize`` on rank 0 between its own barriers.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ._tree import map_tensors
from .errors import IncidentError, ProtocolError
from .events import Event

FORMAT = "nanguard-incident"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPLAY = "replay.json"
VERDICTS = ("reproducible", "not_reproducible")

STATE, BATCHES, RNG = "state.pt", "batches.pt", "rng.pt"
EVENTS, ENVIRONMENT = "events.json", "environment.json"
_RANK_FILES = (STATE, BATCHES, RNG, EVENTS, ENVIRONMENT)
_REQUIRED_FILES = (STATE, RNG, EVENTS, ENVIRONMENT)  # batches.pt only with capture_batch

_MAX_ID_LENGTH = 64  # of the job-id part of a folder name: leaves room for "-stepN-K" under NAME_MAX
_SHA256 = re.compile(r"[0-9a-f]{64}")


# --- the step's inputs and random state, held cheaply until an incident is written ----------


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors are detached CPU copies (same dtype), containers rebuilt."""
    return to_device(obj, torch.device("cpu"))


def to_device(obj: Any, device: torch.device) -> Any:
    """A copy of ``obj`` whose tensors are detached copies on ``device`` (same dtype), containers
    rebuilt (``_tree.map_tensors``). A DTensor contributes its local shard (``.to_local()``).
    CPU tensors are copied too: the copy is taken once an incident is written, and must not
    change if the training code later modifies its batch in place.
    """
    def copy_to(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        to_local = getattr(tensor, "to_local", None)
        if to_local is not None:
            tensor = to_local()
        return tensor.to(device, copy=True)

    return map_tensors(obj, copy_to)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _cuda_in_use() -> bool:
    # Never create a CUDA context just to read a state: a CPU job on a GPU host would pay for
    # one on every rank, and a CUDA that was never initialised has drawn no random numbers.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_snapshot(numpy: bool = True) -> dict[str, Any]:
    """Every RNG state of this process: python, numpy (if the process imported it), torch CPU,
    each CUDA device in use. Only raw copies here, no device sync; ``write_rank`` turns them into
    what ``torch.load(weights_only=True)`` reads back. Reading numpy's state costs about 80 us,
    so the per-step snapshot leaves it out (``numpy=False``) and the capture adds it."""
    module = sys.modules.get("numpy") if numpy else None  # never imported: nothing drawn from it
    return {
        "python": random.getstate(),
        "numpy": module.random.get_state(legacy=False) if module is not None else None,
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if _cuda_in_use() else [],
    }


def _rng_record(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    record = dict(snapshot)
    state = snapshot.get("numpy")
    if state is not None and "state" in state:
        numpy = _numpy()
        record["numpy"] = {
            "bit_generator": state["bit_generator"],
            # uint32 -> int64: a dtype every torch version saves and loads
            "key": torch.from_numpy(state["state"]["key"].astype(numpy.int64)),
            "pos": int(state["state"]["pos"]),
            "has_gauss": int(state["has_gauss"]),
            "gauss": float(state["gauss"]),
        }
    return record


def rng_restore(snapshot: Mapping[str, Any]) -> list[str]:
    """Puts back the states of ``rng_snapshot()``; returns notes on what could not be restored.

    A replay on a machine without numpy or with fewer (or no) GPUs still runs: the notes say
    which random numbers will differ, so the replay report can say so.
    """
    notes = []
    random.setstate(snapshot["python"])
    torch.set_rng_state(snapshot["torch"])
    state = _rng_record(snapshot).get("numpy")
    if state is not None:
        numpy = _numpy()
        if numpy is None:
            notes.append("numpy's random state was not restored: numpy is not installed here")
        else:
            numpy.random.set_state({
                "bit_generator": state["bit_generator"],
                "state": {"key": state["key"].numpy().astype(numpy.uint32), "pos": state["pos"]},
                "has_gauss": state["has_gauss"],
                "gauss": state["gauss"],
            })
    cuda = snapshot.get("cuda") or []
    if cuda:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for device, state in enumerate(cuda[:available]):
            torch.cuda.set_rng_state(state, device)
        if available < len(cuda):
            notes.append(f"the CUDA random state of {len(cuda) - available} of {len(cuda)} device(s) was "
                         f"not restored: this machine has {available} GPU(s); random numbers drawn "
                         "on those devices will differ from the original run")
    return notes


def environment_record(*, rank: int, world_size: int, settings: Any = None) -> dict[str, Any]:
    """What ran where: versions, host, devices, rank, world size and the guard's settings."""
    from . import __version__  # here, not at the top: nanguard/__init__ imports the guard, which imports us

    numpy = _numpy()
    cuda = _cuda_in_use()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nanguard": __version__,
        "numpy": numpy.__version__ if numpy is not None else None,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world_size,
        "local_rank": os.environ.get("LOCAL_RANK"),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "current_device": torch.cuda.current_device() if cuda else None,
        "settings": settings,
    }


# --- files: one way to write, one way to hash ------------------------------------------------


def _digest(path: str) -> dict[str, Any]:
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


def _fsync_dir(path: str) -> None:
    # A rename is durable only once the folder that holds the name is fsync'ed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # some network filesystems refuse it
            raise
    finally:
        os.close(fd)


def _atomic_write(path: str, write: Callable[[BinaryIO], Any]) -> dict[str, Any]:
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
    _fsync_dir(os.path.dirname(path) or ".")
    return _digest(path)


def _plain(obj: Any) -> Any:
    """A strict-JSON form of ``obj``: non-finite floats as "nan"/"inf"/"-inf" (as events do),
    tuples as lists, dataclasses and Events as objects, anything else unknown as its str()."""
    if isinstance(obj, Event):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(key): _plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(item) for item in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _write_json(path: str, obj: Any) -> dict[str, Any]:
    text = json.dumps(_plain(obj), indent=1, allow_nan=False) + "\n"
    return _atomic_write(path, lambda f: f.write(text.encode()))


def _write_torch(path: str, obj: Any) -> dict[str, Any]:
    return _atomic_write(path, lambda f: torch.save(obj, f))


# --- writing an incident ----------------------------------------------------------------------


def incident_id(job_id: str | None, step: int) -> str:
    """A folder name every rank can compute: the sanitised job id (TORCHELASTIC_RUN_ID) and the step.

    Runs of characters outside [A-Za-z0-9._-] become "_", and dots, dashes and underscores go
    from both ends (no hidden folder, nothing that reads as an option, no ".."); the id is cut
    to 64 characters.
    """
    job = re.sub(r"[^A-Za-z0-9._-]+", "_", job_id or "").strip("._-")[:_MAX_ID_LENGTH].rstrip("._-")
    return f"{job}-step{step}" if job else f"step{step}"


def new_incident_dir(root: str, incident_id: str) -> str:
    """Creates and returns ``<root>/<incident_id>``, or ``<incident_id>-2``, ``-3``, ... if taken.

    Any existing folder is left alone: a complete earlier incident must never be overwritten,
    and an incomplete one (a capture killed mid-write) is evidence worth keeping and holds rank
    folders that would collide. ``os.mkdir`` is atomic, so two jobs sharing ``root`` cannot
    both get the same name.
    """
    if not incident_id or incident_id in (".", "..") or os.sep in incident_id or incident_id.startswith("."):
        raise IncidentError(os.path.join(root, incident_id),
                            "not a safe folder name, so nothing was created; build it with incident_id()")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise IncidentError(root, f"cannot create the incidents folder ({exc.strerror}); "
                                  "set NANGUARD_DIR to a writable folder") from exc
    suffix = 1
    while True:
        name = incident_id if suffix == 1 else f"{incident_id}-{suffix}"
        path = os.path.join(root, name)
        try:
            os.mkdir(path)
        except FileExistsError:
            suffix += 1
            continue
        except OSError as exc:
            raise IncidentError(path, f"cannot create the incident folder ({exc.strerror}); "
                                      "set NANGUARD_DIR to a writable folder") from exc
        _fsync_dir(root)
        return path


def write_rank(incident_dir: str, rank: int, *, model_state: Mapping[str, Any], optimizer_state: Any = None,
               extra_states: Mapping[str, Any] | None = None, batches: list[Any] | None = None,
               rng: Mapping[str, Any], events: Iterable[Event],
               environment: Mapping[str, Any]) -> dict[str, Any]:
    """Writes this rank's part of the incident as ``<incident_dir>/rank<rank>``, all of it or nothing.

    ``batches`` (already ``to_cpu``'ed) is None when the batch must not be written to disk;
    ``rng`` is an ``rng_snapshot()``; ``environment`` an ``environment_record()``. States are
    saved as given (tensors on any device; ``torch.load`` puts them on the CPU).
    Returns the rank record for ``finalize``: {"rank": k, "files": {"rank<k>/state.pt":
    {"size": n, "sha256": hex}, ...}}. Raises IncidentError if the rank folder already exists
    (nothing is overwritten) or if writing fails (the temporary folder is then removed).
    """
    final = os.path.join(incident_dir, f"rank{rank}")
    tmp = os.path.join(incident_dir, f".rank{rank}.tmp-{os.getpid()}")
    if os.path.lexists(final):
        raise IncidentError(final, "already exists; an incident is never overwritten, so this rank's "
                                   "capture was not written (pick a new folder with new_incident_dir)")
    contents: dict[str, Callable[[str], dict[str, Any]]] = {
        STATE: lambda p: _write_torch(p, {"model": model_state, "optimizer": optimizer_state,
                                          "extra": dict(extra_states or {})}),
        RNG: lambda p: _write_torch(p, _rng_record(rng)),
        EVENTS: lambda p: _write_json(p, [e if isinstance(e, Event) else Event.from_dict(e) for e in events]),
        ENVIRONMENT: lambda p: _write_json(p, environment),
    }
    if batches is not None:
        contents[BATCHES] = lambda p: _write_torch(p, list(batches))
    try:
        # left over by a killed process that had our pid (pids repeat across containers): ours now
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        files = {f"rank{rank}/{name}": write(os.path.join(tmp, name)) for name, write in contents.items()}
        _fsync_dir(tmp)
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "appeared while this rank was writing", final)
        # a directory rename replaces an *empty* target silently, hence the check just above
        os.rename(tmp, final)
        _fsync_dir(incident_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception):
            raise IncidentError(final, f"could not be written ({type(exc).__name__}: {exc}); nothing of it "
                                       "was left behind and training state in memory is untouched") from exc
        raise
    return {"rank": rank, "files": files}


def finalize(incident_dir: str, *, world_size: int, step: int, first_event: Event | Mapping[str, Any],
             rank_records: list[Mapping[str, Any]], capture_batch: bool, sharded: str | None,
             notes: Mapping[str, Any] | None = None) -> str:
    """Writes ``manifest.json`` (the mark of a complete incident) once every rank's part is there.

    ``first_event`` is the job's first event (``Event.to_dict()``), ``rank_records`` what each
    rank's ``write_rank`` returned, ``sharded`` None or how to load the shards (for FSDP2:
    "fsdp2: each rank holds its shard; load rank k's state.pt on rank k with the same world
    size"). Checks that rank folders 0..world_size-1 exist with every listed file at its
    listed size; raises IncidentError otherwise, and then writes no manifest. Returns the
    manifest's path.
    """
    manifest_path = os.path.join(incident_dir, MANIFEST)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "incident": os.path.basename(os.path.normpath(incident_dir)),
        "step": step,
        "world_size": world_size,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "first_event": _plain(first_event),  # an Event or its to_dict()
        "ranks": sorted((dict(r) for r in rank_records), key=lambda r: r.get("rank", -1)),
        "capture_batch": capture_batch,
        "sharded": sharded,
        "notes": dict(notes or {}),
        "replay": None,
    }
    if os.path.lexists(manifest_path):
        raise IncidentError(manifest_path, "already exists; an incident is never overwritten, so this one "
                                           "was not finalized (pick a new folder with new_incident_dir)")
    try:
        # Sizes only, not sha256: rank 0 re-reading every rank's state (terabytes for a large
        # sharded model) would outlast the other ranks' collective timeout. A missing or short
        # file is what goes wrong here (a filesystem not shared by all nodes, a full disk);
        # every reader checks the sha256 that each rank computed from its own file.
        _check_manifest(incident_dir, manifest, hashes=False)
    except IncidentError as exc:
        reason = (f"{exc.reason}; no manifest was written, so the incident stays incomplete "
                  "(is NANGUARD_DIR on a filesystem every node shares?)")
        raise IncidentError(exc.path, reason) from exc
    _write_json(manifest_path, manifest)
    return manifest_path


def record_replay(incident_dir: str, report: Mapping[str, Any], *, verify: bool = True) -> str:
    """Stores a replay report as ``replay.json`` and points the manifest at it; returns its path.

    ``report`` must have ``verdict`` ("reproducible" | "not_reproducible") and ``first_event``.
    The incident is verified first (sha256 of every file unless ``verify=False``, for a caller
    that has just verified it): a report must not vouch for files that changed. A later replay
    replaces the report. If the process dies between the two writes, the manifest still
    describes the earlier state and the new replay.json is simply not referenced.
    """
    incident = read_incident(incident_dir, verify=verify)
    path = os.path.join(incident.path, REPLAY)
    if not isinstance(report, Mapping) or report.get("verdict") not in VERDICTS:
        verdict = report.get("verdict") if isinstance(report, Mapping) else None
        raise IncidentError(path, f"not written: the report's verdict {verdict!r} is not one of "
                                  f"{', '.join(VERDICTS)}")
    record = _write_json(path, report)
    manifest = dict(incident.manifest)
    manifest["replay"] = {"file": REPLAY, **record, "verdict": report["verdict"]}
    _write_json(os.path.join(incident.path, MANIFEST), manifest)
    return path


# --- reading an incident ----------------------------------------------------------------------


_TAMPERED = "tampered or truncated; nothing was loaded (copy the incident again from where it was written)"


def _verify_file(incident_dir: str, relpath: str, expected: Mapping[str, Any], *, hashes: bool) -> None:
    path = os.path.join(incident_dir, relpath)
    if not os.path.isfile(path):
        raise IncidentError(path, "missing: listed in the manifest but not on disk (deleted, or the incident "
                                  "was copied in part); copy the whole folder again")
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise IncidentError(path, f"is {size} bytes, the manifest says {expected['size']}: {_TAMPERED}")
    if hashes:
        actual = _digest(path)["sha256"]
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
    allowed = {f"rank{rank}/{name}" for name in _RANK_FILES}
    for relpath, entry in files.items():
        # only our own file names: a manifest must not make us read outside the incident
        if relpath not in allowed:
            raise bad(f"lists an unexpected file {relpath!r}")
        if (not isinstance(entry, Mapping) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"])):
            raise bad(f"has no valid size and sha256 for {relpath}")
    required = _REQUIRED_FILES + ((BATCHES,) if capture_batch else ())
    for name in required:
        if f"rank{rank}/{name}" not in files:
            raise bad(f"lacks {name}")
    if not capture_batch and f"rank{rank}/{BATCHES}" in files:
        raise bad("lists batches.pt although capture_batch is false (the batch was not meant to be on disk)")
    return dict(files)


def _check_manifest(incident_dir: str, manifest: Any, *, hashes: bool) -> None:
    """Every structural rule of a manifest, then every listed file on disk; raises IncidentError."""
    path = os.path.join(incident_dir, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IncidentError(path, f"is not a nanguard incident manifest (its \"format\" is not {FORMAT!r})")
    version = manifest.get("version")
    if version != FORMAT_VERSION:
        hint = ("upgrade nanguard to read it" if isinstance(version, int) and version > FORMAT_VERSION
                else "it was not written by a released nanguard")
        raise IncidentError(path, f"format version {version!r} is not supported (this nanguard reads version "
                                  f"{FORMAT_VERSION}); {hint}")
    types = {"incident": str, "step": int, "world_size": int, "first_event": dict, "ranks": list,
             "capture_batch": bool, "sharded": (str, type(None)), "replay": (dict, type(None))}
    for key, kind in types.items():
        if not isinstance(manifest.get(key), kind) or (kind is int and isinstance(manifest[key], bool)):
            raise IncidentError(path, f"field {key!r} is missing or has the wrong type; "
                                      "the manifest is damaged")
    world_size = manifest["world_size"]
    ranks = [r.get("rank") if isinstance(r, Mapping) else None for r in manifest["ranks"]]
    if world_size < 1 or ranks != list(range(world_size)):
        raise IncidentError(path, f"lists ranks {ranks} for a world size of {world_size}; every rank must "
                                  "appear once (did a rank's record not reach rank 0?)")
    try:
        Event.from_dict(manifest["first_event"])
    except ProtocolError as exc:
        raise IncidentError(path, f"first_event is not a valid event ({exc})") from exc
    records = [_check_record(path, record, k, manifest["capture_batch"])
               for k, record in enumerate(manifest["ranks"])]
    replay = manifest["replay"]
    if replay is not None and (replay.get("file") != REPLAY or replay.get("verdict") not in VERDICTS):
        raise IncidentError(path, "field 'replay' does not point at replay.json with a known verdict; "
                                  "the manifest is damaged")
    # all structure first, then the disk: nothing is read before the manifest is known to be sane
    for k, files in enumerate(records):
        rank_dir = os.path.join(incident_dir, f"rank{k}")
        if not os.path.isdir(rank_dir):
            raise IncidentError(rank_dir, f"missing: the manifest lists rank {k} but its folder is not there "
                                          "(deleted, or the incident was copied in part)")
        for relpath, entry in files.items():
            _verify_file(incident_dir, relpath, entry, hashes=hashes)
    if replay is not None:
        _verify_file(incident_dir, REPLAY, replay, hashes=hashes)


@dataclass(frozen=True)
class Incident:
    """A verified incident folder. The ``rank_*`` methods load one rank's files on demand."""

    path: str
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.manifest["incident"]

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def first_event(self) -> Event:
        return Event.from_dict(self.manifest["first_event"])

    def _file(self, rank: int, name: str) -> str:
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise IncidentError(self.path, f"has no rank {rank!r} (its world size is {self.world_size})")
        return os.path.join(self.path, f"rank{rank}", name)

    def _torch_load(self, path: str, *, weights_only: bool, map_location: Any = "cpu") -> Any:
        try:
            return torch.load(path, map_location=map_location, weights_only=weights_only)
        except Exception as exc:
            hint = (" (it holds Python objects that weights_only loading refuses; if you trust this folder, "
                    "load it yourself with torch.load(..., weights_only=False))") if weights_only else ""
            raise IncidentError(path, f"could not be loaded: {type(exc).__name__}: {exc}{hint}") from exc

    def _json(self, path: str) -> Any:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise IncidentError(path, f"could not be read as JSON ({exc})") from exc

    def rank_state(self, rank: int, map_location: Any = "cpu") -> dict[str, Any]:
        """{"model": state_dict, "optimizer": state_dict or None, "extra": {"scaler": ..., ...}}."""
        return self._torch_load(self._file(rank, STATE), weights_only=True, map_location=map_location)

    def rank_batches(self, rank: int) -> list[Any] | None:
        """The step's micro-batches, [{"args": ..., "kwargs": ...}, ...]; None without capture_batch."""
        if not self.manifest["capture_batch"]:
            return None
        # Batches are arbitrary Python containers (namedtuples, dataclasses of the user's code),
        # which weights_only loading refuses, so this is a full unpickle. The sha256 check in
        # read_incident guarantees these are the bytes the capture wrote (not corrupted or cut
        # short); like any pickle, only replay incidents from a source you trust.
        return self._torch_load(self._file(rank, BATCHES), weights_only=False)

    def rank_rng(self, rank: int) -> dict[str, Any]:
        """The rank's ``rng_snapshot()`` from the start of the step, for ``rng_restore``."""
        return self._torch_load(self._file(rank, RNG), weights_only=True)

    def rank_events(self, rank: int) -> list[Event]:
        path = self._file(rank, EVENTS)
        data = self._json(path)
        if not isinstance(data, list):
            raise IncidentError(path, "is not a list of events")
        try:
            return [Event.from_dict(item) for item in data]
        except ProtocolError as exc:
            raise IncidentError(path, f"holds an invalid event ({exc})") from exc

    def environment(self, rank: int) -> dict[str, Any]:
        return self._json(self._file(rank, ENVIRONMENT))

    def replay_report(self) -> dict[str, Any] | None:
        """The report of the last replay (replay.json), or None if the incident was not replayed."""
        if self.manifest["replay"] is None:
            return None
        return self._json(os.path.join(self.path, REPLAY))


def read_incident(incident_dir: str, *, verify: bool = True) -> Incident:
    """Opens an incident folder after checking all of it; raises IncidentError naming the file at fault.

    With ``verify`` every file's sha256 is checked against the manifest; without, only that
    it exists with the listed size. Nothing is loaded before every check has passed.
    """
    path = os.path.abspath(incident_dir)
    if not os.path.isdir(path):
        what = "not a folder" if os.path.exists(path) else "no such incident folder"
        raise IncidentError(path, f"{what}; incidents are written under NANGUARD_DIR "
                                  "(default ./nanguard-incidents)")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        found = ", ".join(sorted(os.listdir(path))) or "nothing"
        raise IncidentError(manifest_path, "incomplete: no manifest.json; the capture did not finish "
                                           f"(a crash or kill during the write?); the folder holds: {found}")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise IncidentError(manifest_path, f"is not valid JSON ({exc}); the manifest is damaged") from exc
    _check_manifest(path, manifest, hashes=verify)
    return Incident(path=path, manifest=manifest)
