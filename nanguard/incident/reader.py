"""Reading an incident: all of it is checked when it is opened, each rank's files load on demand."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import IncidentError, ProtocolError
from ..events import Event
from .batches import decode
from .manifest import (
    BATCHES,
    ENVIRONMENT,
    EVENTS,
    FLIGHT,
    MANIFEST,
    REPLAY,
    RNG,
    STATE,
    check_manifest,
    rank_folder,
)


def _json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise IncidentError(path, f"could not be read as JSON ({exc})") from exc


def _torch_load(path: str, *, weights_only: bool, map_location: Any = "cpu") -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        hint = (" (it holds Python objects that weights_only loading refuses; if you trust this folder, "
                "load it yourself with torch.load(..., weights_only=False))") if weights_only else ""
        raise IncidentError(path, f"could not be loaded: {type(exc).__name__}: {exc}{hint}") from exc


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
        return os.path.join(self.path, rank_folder(rank), name)

    def rank_state(self, rank: int, map_location: Any = "cpu") -> dict[str, Any]:
        """{"model": state_dict, "optimizer": state_dict or None, "extra": {"scaler": ..., ...}}."""
        return _torch_load(self._file(rank, STATE), weights_only=True, map_location=map_location)

    def rank_batches(self, rank: int, notes: list[str] | None = None) -> list[Any] | None:
        """The step's micro-batches, [{"args": ..., "kwargs": ...}, ...]; None without capture_batch.

        Loaded as data only (weights_only): an incident folder may come from anywhere, and
        unpickling runs code. What could not be rebuilt as it was fed is added to ``notes``.
        """
        if not self.manifest["capture_batch"]:
            return None
        path = self._file(rank, BATCHES)
        notes = [] if notes is None else notes
        try:
            batches = decode(_torch_load(path, weights_only=True), notes)
        except IncidentError as exc:
            written = ("an incident written by nanguard 0.1, which pickled them" if self.manifest["version"] < 2
                       else "not as nanguard writes them: the folder is damaged or was crafted")
            raise IncidentError(path, f"holds Python objects that only unpickling would rebuild ({written});"
                                      " nanguard does not unpickle incident files (an incident folder is data,"
                                      " and unpickling runs code), so nothing was loaded") from exc
        except (ValueError, TypeError) as exc:
            raise IncidentError(path, f"does not hold batches as nanguard writes them ({exc}); the"
                                      " folder is damaged or was crafted; nothing was loaded") from exc
        if not isinstance(batches, list) or not all(
                isinstance(b, dict) and set(b) == {"args", "kwargs"} for b in batches):
            raise IncidentError(path, "does not hold a list of {args, kwargs} micro-batches; the folder"
                                      " is damaged or was crafted; nothing was loaded")
        return batches

    def rank_rng(self, rank: int) -> dict[str, Any]:
        """The rank's ``rng_snapshot()`` from the start of the step, for ``rng_restore``."""
        return _torch_load(self._file(rank, RNG), weights_only=True)

    def rank_events(self, rank: int) -> list[Event]:
        path = self._file(rank, EVENTS)
        data = _json(path)
        if not isinstance(data, list):
            raise IncidentError(path, "is not a list of events")
        try:
            return [Event.from_dict(item) for item in data]
        except ProtocolError as exc:
            raise IncidentError(path, f"holds an invalid event ({exc})") from exc

    def rank_flight(self, rank: int) -> Any:
        """The rank's flight.json as written (rank/flight.py's format), or None where it was not
        kept (flight_steps=0, or an incident older than the recorder); not validated here
        (``incident.flight.parse`` checks it)."""
        if f"{rank_folder(rank)}/{FLIGHT}" not in self.manifest["ranks"][rank]["files"]:
            return None
        return _json(self._file(rank, FLIGHT))

    def environment(self, rank: int) -> dict[str, Any]:
        return _json(self._file(rank, ENVIRONMENT))

    def replay_report(self) -> dict[str, Any] | None:
        """The report of the last replay (replay.json), or None if the incident was not replayed."""
        if self.manifest["replay"] is None:
            return None
        return _json(os.path.join(self.path, REPLAY))


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
    check_manifest(path, manifest, hashes=verify)
    return Incident(path=path, manifest=manifest)
