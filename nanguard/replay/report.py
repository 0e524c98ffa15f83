"""A replay's verdict and its report (what replay.json holds): the comparison with the original
event, the operations, the bad samples and what the devices say."""

from __future__ import annotations

import datetime
import platform
import socket
from typing import Any

import torch

from ..errors import IncidentError
from ..events import Event
from ..incident import Incident
from . import devices
from .layout import Layout


def build_report(incident: Incident, world: int, event: Event | None, traces: list[dict[str, Any]],
                 layout: Layout) -> dict[str, Any]:
    """Compare the replay's first event with the original one: the verdict and what supports it.
    ``traces``: every rank's {"rank", "trace", "notes", "operations", "samples", "device"}."""
    original = incident.first_event
    same = {"kind": event is not None and event.kind == original.kind,
            "layer": event is not None and event.layer == original.layer,
            "step": event is not None and event.step == original.step}
    reproducible = all(same.values())
    notes = sorted({note for t in traces for note in t["notes"]})
    suspect = _suspect(incident, original)
    own_data = any(t.get("own_data") for t in traces)
    bad_state = {t["rank"]: t["bad_state"] for t in traces if t.get("bad_state")}
    unfed = _unfed(original, traces)
    if reproducible and None not in (event.micro_batch, original.micro_batch) and event.micro_batch != original.micro_batch:
        notes.append(f"found at micro-batch {event.micro_batch} here, at micro-batch {original.micro_batch} in the"
                     " original: the incident holds the state as it was at the stop, so what was written into"
                     " the weights or buffers between the step's micro-batches is in place from the first one here")
    if not torch.cuda.is_available() and suspect["device"] not in ("cpu", None):
        notes.append(f"replayed on the CPU: the original ran on {suspect['device']}; GPU kernels do not give"
                     " bit-identical results, so a fault of a GPU kernel may not show here")
    other_rank = layout.alone and layout.part != original.rank
    return {
        "verdict": "reproducible" if reproducible else "not_reproducible",
        "message": _message(original, event, reproducible, suspect, layout, own_data, bad_state, unfed),
        "incident": incident.name,
        "step": incident.step,
        "world_size": world,
        "original_event": original.to_dict(),
        "first_event": event.to_dict() if event is not None else None,
        "same": same,
        "suspects": [] if reproducible or other_rank or own_data or bad_state or unfed else [suspect],
        "own_data": own_data,
        "bad_state": {str(rank): names for rank, names in bad_state.items()},
        "trace": {str(t["rank"]): t["trace"] for t in traces},
        "notes": notes,
        "layout": {"incident_world_size": incident.world_size, "replayed_ranks": [t["rank"] for t in traces],
                   "alone": layout.alone},
        "operations": {str(t["rank"]): t["operations"] for t in traces},
        "samples": {str(t["rank"]): t["samples"] for t in traces},
        "bad_samples": bad_samples(traces),
        "skip_file": None,
        "devices": _devices(incident, original, event, traces, reproducible, _silent(reproducible, own_data, unfed,
                                                                                     bad_state)),
        "replayed": {"host": socket.gethostname(), "python": platform.python_version(),
                     "torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                     and torch.cuda.is_initialized() else "cpu",
                     "time": _now()},
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _silent(reproducible: bool, own_data: bool, unfed: list[str], bad_state: dict[int, list[str]]) -> str | None:
    """Why this replay says nothing of the original device, or None: it did not reproduce the event
    without all the step had, or the state it was given was bad already (whatever it found)."""
    why = ("not fed all of the step's own data, the replay says nothing of the device" if own_data else
           "the replay could not give the step all it had (see the message), so it says nothing of the device"
           if unfed else
           "the captured state already held non-finite values, the replay says nothing of the device"
           if bad_state else None)
    return why if bad_state or not reproducible else None


def _unfed(original: Event, traces: list[dict[str, Any]]) -> list[str]:
    """What of the original step a replay could not give it beside the incident's data (which
    ``own_data`` covers): why one that ran clean says nothing of the hardware."""
    reasons = []
    if original.kind in ("loss", "check"):
        reasons.append("the original value was found in the loss (or a tensor the script checked), which also takes"
                       " what the incident does not hold (the labels, the targets): the script's own loader gave"
                       " those here")
    if any(t.get("host_rng_drawn") for t in traces):
        reasons.append("the step drew from Python's or numpy's random generator (random, np.random: a layer drop,"
                       " an augmentation), whose state as the step began the incident does not hold (it is read at"
                       " the stop, after the step's draws), so it drew other numbers here")
    if any(t.get("other_script") for t in traces):
        reasons.append("the script's model is not the one that made the incident (see the notes)")
    return reasons


def _message(original: Event, event: Event | None, reproducible: bool, suspect: dict[str, Any],
             layout: Layout, own_data: bool, bad_state: dict[int, list[str]], unfed: list[str]) -> str:
    where = f"{original.kind} event in {original.layer or 'the loss'} at step {original.step}"
    held = "; ".join(f"rank {rank}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                     for rank, names in sorted(bad_state.items()))
    if reproducible and bad_state:
        return (f"the same {where} happened again with the captured weights, batch and random state, which"
                f" already held non-finite values before the step began ({held}): the step used them, it did not"
                " make them; they were written by an earlier step let through, a checkpoint loaded, or code"
                " between steps (see the trace)")
    if reproducible:
        return (f"the same {where} happened again with the captured weights, batch and random"
                " state: a deterministic bug in the model, the data or the code (see the trace)")
    if layout.alone and layout.part != original.rank:
        return (f"rank {layout.part} was replayed alone and the original {where} came from rank"
                f" {original.rank}: this replay cannot reproduce it and says nothing of rank"
                f" {original.rank}'s hardware (NANGUARD_REPLAY_RANK={original.rank} replays that rank)")
    found = "the step ran clean" if event is None else f"the replay found a different first event ({event})"
    if bad_state:
        return (f"{found}, but the captured state already holds non-finite values ({held}): they were there"
                " before the step began, so the step did not make them, and this replay says nothing of the"
                " hardware that ran it. The replayed step did not use them as they were (something put"
                " finite values in their place first, as DDP's broadcast of rank 0's buffers does, or read"
                f" them elsewhere); the original {where} may have come from them. They were written by an earlier"
                " step let through, a checkpoint loaded, or code between steps (an evaluation with the model in"
                " train mode writes BatchNorm's statistics)")
    if own_data:
        return (f"{found}, but not on the step's own data alone: the script's own inputs took the place"
                " of what the incident does not hold, or some of its micro-batches were never fed (see the"
                f" notes). The original {where} may have come with that data, so this replay says nothing"
                " of the hardware")
    if unfed:
        return (f"{found}, but {'; and '.join(unfed)}. The original {where} may have come from that, so this"
                " replay says nothing of the hardware")
    hardware = f"the hardware that ran it (host {suspect['host']}, device {suspect['device']}, rank {original.rank})"
    if event is None:
        return (f"the step ran clean with the captured weights, batch and random state, so the original {where}"
                f" did not recur. Suspects, in order: {_SCRIPT_STATE}; then non-determinism (atomics in kernels,"
                f" inputs from outside the captured batch); then a transient fault of {hardware}")
    return (f"the replay found a different first event ({event}) than the original {where}. Suspects, in order:"
            f" {_SCRIPT_STATE}; then non-determinism; then {hardware}")


_SCRIPT_STATE = ("the script's own state, which a replay cannot give back: it runs the script from its own step 0,"
                 " so code keyed on its loop counter or its rank (if step == 30 and rank == 1), on Python or numpy"
                 " draws or on a global took another path here (key such code on guard.step)")


def _suspect(incident: Incident, original: Event) -> dict[str, Any]:
    record = devices.original(incident, original.rank, original)
    return {"rank": original.rank, "host": record["host"],
            "device": record["name"] if record["device"] != "cpu" else "cpu"}


def _devices(incident: Incident, original: Event, event: Event | None, traces: list[dict[str, Any]],
             reproducible: bool, silent: str | None) -> dict[str, Any]:
    """The original device against this replay's (and earlier replays') for the rank that saw it.
    A replay that cannot speak of it (``silent``: why, ``_silent``) leaves the earlier replays'
    records as they were."""
    try:
        earlier = devices.earlier_runs(incident.replay_report())
    except IncidentError:
        earlier = []
    mine = next((t["device"] for t in traces if t["rank"] == original.rank), None)
    if mine is None:
        return {"finding": "not_compared", "replayed": None, "replays": earlier,
                "message": f"rank {original.rank}, whose device saw the incident, was not replayed"}
    if silent is not None:
        return {"finding": "not_compared", "replayed": mine, "replays": earlier, "message": silent}
    run = {**mine, "rank": original.rank, "bad": event is not None, "reproducible": reproducible,
           "time": _now()}
    return devices.compare(devices.original(incident, original.rank, original), earlier + [run],
                           _near_limit(original))


def _near_limit(event: Event) -> bool:
    """Whether the original bad tensor's finite values came within 1e3 of its dtype's limit."""
    dtype = getattr(torch, event.dtype or "", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return False
    extreme = max(abs(v) for v in (event.finite_min or 0.0, event.finite_max or 0.0))
    return extreme >= torch.finfo(dtype).max / 1e3


def bad_samples(traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every bad sample found, across ranks and micro-batches: {"rank", "micro_batch", "index", "id"}."""
    found = []
    for t in traces:
        for entry in (t.get("samples") or {}).get("micro_batches", []):
            ids = entry.get("ids")
            found += [{"rank": t["rank"], "micro_batch": entry["micro_batch"], "index": index,
                       "id": ids[i] if ids else None} for i, index in enumerate(entry["bad"])]
    return found
