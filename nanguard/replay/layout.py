"""Which rank's part of an incident this process replays.

With the incident's world size every rank replays its own part. One process may replay one
rank's part alone (an 8-rank incident on a 1-GPU workstation) when the model is not sharded:
every rank then holds the same weights, and the rank's own batch and RNG make its step. A
sharded model's part cannot run alone, and is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import IncidentError
from ..incident import Incident


@dataclass(frozen=True, slots=True)
class Layout:
    part: int
    """the incident's rank whose state, batch and RNG this process replays"""
    alone: bool
    """one process replays one rank of a larger incident"""
    note: str | None = None


def choose(incident: Incident, rank: int, world: int, wanted: int | None) -> Layout:
    """The part this process (``rank`` of ``world``) replays; ``wanted``: NANGUARD_REPLAY_RANK."""
    size = incident.world_size
    if world == size:
        if wanted is not None and wanted != rank:
            raise IncidentError(incident.path, f"NANGUARD_REPLAY_RANK={wanted} picks the rank that one process"
                                               f" replays alone; this job has the incident's {size} rank(s),"
                                               " so each replays its own part: unset it")
        return Layout(part=rank, alone=False)
    if world != 1:
        raise IncidentError(incident.path, f"was captured on {size} rank(s) and this process is one of {world};"
                                           f" replay it with torchrun with {size} processes in all (for example"
                                           f" --nproc-per-node {size}), or with one process, which replays one"
                                           " rank's part alone (NANGUARD_REPLAY_RANK) when the model is not"
                                           " sharded")
    sharded = incident.manifest["sharded"]
    if sharded:
        raise IncidentError(incident.path, f"was captured on {size} ranks with a sharded model ({sharded}): one"
                                           " rank's shards cannot run alone; replay it with torchrun with"
                                           f" {size} processes in all (for example --nproc-per-node {size})")
    first = incident.first_event.rank
    part = first if wanted is None else wanted
    if not 0 <= part < size:
        raise IncidentError(incident.path, f"has no rank {part} (NANGUARD_REPLAY_RANK; its world size is {size})")
    note = (f"rank {part}'s part was replayed alone in one process (the incident has {size} ranks; the model"
            " is not sharded, so every rank holds the same weights): the other ranks' batches and the"
            " gradient all-reduce are not part of it, so its gradients are rank "
            f"{part}'s own, and a value another rank sent cannot appear")
    if part != first:
        note += (f"; the job's first event came from rank {first}, which this replay does not run: it cannot"
                 f" reproduce that event (NANGUARD_REPLAY_RANK={first} replays that rank)")
    return Layout(part=part, alone=True, note=note)
