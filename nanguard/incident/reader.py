"""Reading an incident: all of it is checked when it is opened, each rank's files load on demand."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import IncidentError, ProtocolError
from ..events import Event
from .batches import decode
from .fsio import read_json
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
    inside,
    rank_folder,
)
from .rng import check_record

_DAMAGED = "the folder is damaged or was crafted; nothing was loaded"
_NO_PICKLES = ("nanguard does not unpickle incident files (an incident folder is data, and unpickling runs"
               " code), so nothing was loaded")


def _json(path: str) -> Any:
    return read_json(path, "could not be read as JSON", _DAMAGED)


def _torch_load(path: str, map_location: Any = "cpu") -> Any:
    """A torch file as data only (weights_only): never unpickled, whatever it holds."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 (a damaged or crafted file makes torch raise anything)
        # not torch's message: it advises weights_only=False, which would run a crafted file's code
        raise IncidentError(path, f"could not be loaded as data ({type(exc).__name__}): it is not as nanguard"
                                  f" writes it: the folder is damaged or was crafted; {_NO_PICKLES}") from exc


def _check_state(state: Any, path: str) -> dict[str, Any]:
    """state.pt's content, once it is {"model": state dict, "optimizer": state dict or None, "extra": {...}}."""
    optimizer = state.get("optimizer") if isinstance(state, dict) else None
    if not (isinstance(state, dict) and isinstance(state.get("model"), dict)
            and all(isinstance(key, str) for key in state["model"])
            and isinstance(state.get("extra", {}), dict)
            and (optimizer is None or (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
                                       and isinstance(optimizer.get("param_groups"), list)
                                       and all(isinstance(g, dict) for g in optimizer["param_groups"])))):
        raise IncidentError(path, "does not hold a model's and an optimizer's states as nanguard writes them"
                                  f" ({{model, optimizer, extra}}); {_DAMAGED}")
    return state


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
        path = self._file(rank, STATE)
        return _check_state(_torch_load(path, map_location=map_location), path)

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
            batches = decode(_torch_load(path), notes)
        except IncidentError as exc:
            if self.manifest["version"] >= 2:
                raise
            raise IncidentError(path, "holds Python objects that only unpickling would rebuild (an incident"
                                      f" written by nanguard 0.1, which pickled them); {_NO_PICKLES}") from exc
        except (ValueError, TypeError) as exc:
            raise IncidentError(path, f"does not hold batches as nanguard writes them ({exc}); the"
                                      " folder is damaged or was crafted; nothing was loaded") from exc
        if not isinstance(batches, list) or not all(
                isinstance(b, dict) and set(b) == {"args", "kwargs"} and isinstance(b["args"], (list, tuple))
                and isinstance(b["kwargs"], Mapping) and all(isinstance(k, str) for k in b["kwargs"])
                for b in batches):
            raise IncidentError(path, "does not hold a list of {args: list, kwargs: dict} micro-batches;"
                                      f" {_DAMAGED}")
        return batches

    def rank_rng(self, rank: int) -> dict[str, Any]:
        """The rank's ``rng_snapshot()`` from the start of the step, for ``rng_restore``, checked to
        fit its generators (a replay restores it only after it has loaded weights)."""
        path = self._file(rank, RNG)
        record = _torch_load(path)
        problem = check_record(record)
        if problem is not None:
            raise IncidentError(path, f"does not hold random states as nanguard writes them ({problem}); {_DAMAGED}")
        return record

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
        (``incident.flight_chart.parse`` checks it)."""
        if f"{rank_folder(rank)}/{FLIGHT}" not in self.manifest["ranks"][rank]["files"]:
            return None
        return _json(self._file(rank, FLIGHT))

    def environment(self, rank: int) -> dict[str, Any]:
        path = self._file(rank, ENVIRONMENT)
        env = _json(path)
        if not isinstance(env, dict):
            raise IncidentError(path, f"is not an object describing the rank's machine; {_DAMAGED}")
        return env

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
        _no_manifest(path, manifest_path)
    inside(path, manifest_path)
    manifest = read_json(manifest_path, "is not valid JSON", "the manifest is damaged")
    check_manifest(path, manifest, hashes=verify)
    return Incident(path=path, manifest=manifest)


def _no_manifest(path: str, manifest_path: str) -> None:
    """IncidentError for a folder without a manifest: an unfinished capture, or no incident at all."""
    names = sorted(os.listdir(path))
    if names and not any(re.fullmatch(r"rank\d+|manifest\.json\.tmp-\d+", name) for name in names):
        # an unfinished capture holds nothing yet, or its rank folders
        raise IncidentError(path, "is not an incident folder (it holds no manifest.json and no rank folders);"
                                  " incidents are written under NANGUARD_DIR (default ./nanguard-incidents),"
                                  " one folder each: give one of those")
    found = ", ".join(repr(name) for name in names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    raise IncidentError(manifest_path, "incomplete: no manifest.json; the capture did not finish "
                                       f"(a crash or kill during the write?); the folder holds: {found}")
