"""Incident folders: every rank's state from before the bad update, written atomically and read
back verified.

    fsio      atomic writes, sha256, the JSON form, torch.save
    rng       the random states of a process: snapshot, restore, their record on disk
    manifest  the format: names, the manifest, every rule a manifest must follow
    writer    one rank's part, the manifest, the replay report; the capture across ranks
    reader    Incident and read_incident
    flight_chart  the flight recorder (flight.json): its format, checked as untrusted input, and its drawing
    replay_lines  a replay's report (replay.json) as readable lines: the replay prints them, and
                  ``nanguard inspect``
    inspection  what ``nanguard inspect`` prints (imported on its own, by the CLI)

No hooks and no ``torch.distributed`` here: ``capture_incident`` takes its collectives as an
argument and plain data from the caller.
"""

from ..errors import IncidentError
from .manifest import (
    BATCHES,
    ENVIRONMENT,
    EVENTS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    REPLAY,
    RNG,
    STATE,
    VERDICTS,
)
from .reader import Incident, read_incident
from .rng import rng_restore, rng_snapshot
from .writer import (
    Collectives,
    RankPart,
    capture_incident,
    environment_record,
    finalize,
    incident_id,
    new_incident_dir,
    record_replay,
    to_cpu,
    to_device,
    write_rank,
)

__all__ = [
    "BATCHES",
    "Collectives",
    "ENVIRONMENT",
    "EVENTS",
    "FORMAT",
    "FORMAT_VERSION",
    "Incident",
    "IncidentError",
    "MANIFEST",
    "REPLAY",
    "RNG",
    "RankPart",
    "STATE",
    "VERDICTS",
    "capture_incident",
    "environment_record",
    "finalize",
    "incident_id",
    "new_incident_dir",
    "read_incident",
    "record_replay",
    "rng_restore",
    "rng_snapshot",
    "to_cpu",
    "to_device",
    "write_rank",
]
