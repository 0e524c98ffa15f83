"""Writing an incident: one rank's part, the manifest that completes it, and the whole capture
across ranks.

Why a folder with a manifest can be trusted: each rank writes into a hidden temporary folder and
renames it to ``rank<k>`` only once every file in it is on disk (fsync'ed); the manifest, which
lists every file with its size and sha256, is written after all of them. A crash or kill at any
point therefore leaves either a folder without ``manifest.json`` (which ``read_incident`` reports
as incomplete) or a complete incident, never one that looks complete and is not.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import re
import shutil
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._tree import map_tensors
from .._version import __version__
from ..errors import IncidentError
from ..events import Event
from .batches import encode
from .fsio import fsync_dir, write_json, write_torch
from .manifest import (
    BATCHES,
    ENVIRONMENT,
    EVENTS,
    FLIGHT,
    MANIFEST,
    REPLAY,
    RNG,
    STATE,
    VERDICTS,
    build_manifest,
    check_manifest,
    rank_folder,
)
from .reader import read_incident
from .rng import cuda_in_use, optional_numpy, rng_record

log = logging.getLogger("nanguard")

_MAX_ID_LENGTH = 64  # of the job-id part of a folder name: leaves room for "-stepN-K" under NAME_MAX


# --- the step's inputs, copied once an incident is written ----------------------------------


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


def environment_record(*, rank: int, world_size: int, settings: Any = None) -> dict[str, Any]:
    """What ran where: versions, host, devices, rank, world size and the guard's settings."""
    numpy = optional_numpy()
    cuda = cuda_in_use()
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


# --- the pieces of an incident ----------------------------------------------------------------


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
        fsync_dir(root)
        return path


def write_rank(incident_dir: str, rank: int, *, model_state: Mapping[str, Any], optimizer_state: Any = None,
               extra_states: Mapping[str, Any] | None = None, batches: list[Any] | None = None,
               rng: Mapping[str, Any], events: Iterable[Event],
               environment: Mapping[str, Any], flight: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Writes this rank's part of the incident as ``<incident_dir>/rank<rank>``, all of it or nothing.

    ``batches`` (the micro-batches as fed, written as data: ``batches.encode``, tensors copied to
    the CPU) is None when the batch must not be written to disk;
    ``rng`` is an ``rng_snapshot()``; ``environment`` an ``environment_record()``. States are
    saved as given (tensors on any device; ``torch.load`` puts them on the CPU).
    Returns the rank record for ``finalize``: {"rank": k, "files": {"rank<k>/state.pt":
    {"size": n, "sha256": hex}, ...}}. Raises IncidentError if the rank folder already exists
    (nothing is overwritten) or if writing fails (the temporary folder is then removed).
    """
    folder = rank_folder(rank)
    final = os.path.join(incident_dir, folder)
    tmp = os.path.join(incident_dir, f".{folder}.tmp-{os.getpid()}")
    if os.path.lexists(final):
        raise IncidentError(final, "already exists; an incident is never overwritten, so this rank's "
                                   "capture was not written (pick a new folder with new_incident_dir)")
    contents: dict[str, Callable[[str], dict[str, Any]]] = {
        STATE: lambda p: write_torch(p, {"model": model_state, "optimizer": optimizer_state,
                                         "extra": dict(extra_states or {})}),
        RNG: lambda p: write_torch(p, rng_record(rng)),
        EVENTS: lambda p: write_json(p, [e if isinstance(e, Event) else Event.from_dict(e) for e in events]),
        ENVIRONMENT: lambda p: write_json(p, environment),
    }
    if batches is not None:
        contents[BATCHES] = lambda p: write_torch(p, encode(list(batches)))
    if flight is not None:
        contents[FLIGHT] = lambda p: write_json(p, flight)
    try:
        # left over by a killed process that had our pid (pids repeat across containers): ours now
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        files = {f"{folder}/{name}": write(os.path.join(tmp, name)) for name, write in contents.items()}
        fsync_dir(tmp)
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "appeared while this rank was writing", final)
        # a directory rename replaces an *empty* target silently, hence the check just above
        os.rename(tmp, final)
        fsync_dir(incident_dir)
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
    manifest = build_manifest(incident_dir, world_size=world_size, step=step, first_event=first_event,
                              rank_records=rank_records, capture_batch=capture_batch, sharded=sharded,
                              notes=notes)
    if os.path.lexists(manifest_path):
        raise IncidentError(manifest_path, "already exists; an incident is never overwritten, so this one "
                                           "was not finalized (pick a new folder with new_incident_dir)")
    try:
        # Sizes only, not sha256: rank 0 re-reading every rank's state (terabytes for a large
        # sharded model) would outlast the other ranks' collective timeout. A missing or short
        # file is what goes wrong here (a filesystem not shared by all nodes, a full disk);
        # every reader checks the sha256 that each rank computed from its own file.
        check_manifest(incident_dir, manifest, hashes=False)
    except IncidentError as exc:
        reason = (f"{exc.reason}; no manifest was written, so the incident stays incomplete "
                  "(is NANGUARD_DIR on a filesystem every node shares?)")
        raise IncidentError(exc.path, reason) from exc
    write_json(manifest_path, manifest)
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
    record = write_json(path, report)
    manifest = dict(incident.manifest)
    manifest["replay"] = {"file": REPLAY, **record, "verdict": report["verdict"]}
    write_json(os.path.join(incident.path, MANIFEST), manifest)
    return path


# --- one incident across ranks ----------------------------------------------------------------


class Collectives(Protocol):
    """What the capture needs of a process group: ``nanguard._dist.Collectives``, or a test's fake."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def active(self) -> bool:
        """False before a process group exists: the collectives then reach this process alone."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """What one rank puts into an incident, as plain data (``write_rank`` says how each is saved)."""

    model_state: Mapping[str, Any]
    """the model's state_dict; tensors on any device"""
    rng: Mapping[str, Any]
    """an ``rng_snapshot()`` from the start of the step"""
    events: Sequence[Event]
    """this rank's recent events"""
    optimizer_state: Any = None
    extra_states: Mapping[str, Any] = field(default_factory=dict)
    """other state_dicts by name ("scaler", "scheduler", ...)"""
    batches: list[Any] | None = None
    """the step's micro-batches as fed, [{"args": ..., "kwargs": ...}, ...]; copied to the CPU as
    data when written (``batches.encode``); None: the batch must not go to disk"""
    settings: Any = None
    """the guard's settings as plain data (no secrets), for environment.json"""
    flight: Mapping[str, Any] | None = None
    """the flight recorder's rows (rank/flight.py), for flight.json"""


def capture_incident(collectives: Collectives, root: str, first_event: Event,
                     collect: Callable[[], RankPart], *, job_id: str | None, capture_batch: bool,
                     sharded: str | None) -> str | None:
    """Every rank writes its part of one incident folder under ``root``; rank 0 writes the manifest last.

    Called on every rank of the group at the same step, with the job's first event. Rank 0 creates
    the folder (named by ``incident_id(job_id, first_event.step)``) and broadcasts its path; each
    rank then calls ``collect()`` for its plain data and writes it; the rank records are gathered;
    rank 0 writes the manifest if every rank succeeded, and broadcasts the outcome. ``sharded`` is
    rank 0's note for the manifest (see ``finalize``).

    Returns the folder on every rank when the incident is complete, else None on every rank, and
    never raises for a failed capture (it is logged): whatever fails on a rank (``collect()``, a
    copy, the disk), that rank still takes part in every collective, or every other rank would
    wait in it forever. ``collect`` is called only once the folder exists, so a rank spends no
    time or memory on a capture that cannot be written.
    """
    rank = collectives.rank
    # Before init_process_group the collectives reach this process alone, whatever torchrun announced
    world_size = collectives.world_size if collectives.active else 1
    path = _new_folder(root, job_id, first_event.step) if rank == 0 else None
    path = collectives.broadcast_object(path, src=0)
    if path is None:
        return None
    record = _write_part(path, rank, world_size, collect)
    records = collectives.all_gather_object(record)
    complete = all(r is not None for r in records)
    if rank == 0 and complete:
        complete = _finalize(path, world_size=world_size, step=first_event.step, first_event=first_event,
                             rank_records=records, capture_batch=capture_batch, sharded=sharded)
    complete = collectives.broadcast_object(complete, src=0)
    return path if complete else None


def _new_folder(root: str, job_id: str | None, step: int) -> str | None:
    try:
        return new_incident_dir(root, incident_id(job_id, step))
    except (OSError, IncidentError) as exc:
        log.error("nanguard: no incident written: cannot create a folder under %s (%s)", root, exc)
        return None


def _write_part(path: str, rank: int, world_size: int,
                collect: Callable[[], RankPart]) -> dict[str, Any] | None:
    try:
        part = collect()
        return write_rank(
            path, rank, model_state=part.model_state, optimizer_state=part.optimizer_state,
            extra_states=part.extra_states, batches=part.batches,
            rng=part.rng, events=part.events, flight=part.flight,
            environment=environment_record(rank=rank, world_size=world_size, settings=part.settings))
    except Exception:  # noqa: BLE001
        # Whatever failed here (a state_dict, a copy, the disk), this rank must still reach the
        # collectives that follow, or every other rank would hang in them.
        log.exception("nanguard: rank %d could not write its part of the incident", rank)
        return None


def _finalize(path: str, **manifest: Any) -> bool:
    try:
        finalize(path, **manifest)
    except IncidentError as exc:
        log.error("nanguard: the incident could not be completed: %s", exc)
        return False
    return True
