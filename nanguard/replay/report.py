"""A replay's verdict, its report (what replay.json holds) and the report as a few lines."""

from __future__ import annotations

import datetime
import os
import platform
import socket
from typing import Any

import torch

from ..errors import IncidentError
from ..events import Event
from ..incident import Incident


def build_report(incident: Incident, world: int, event: Event | None, traces: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """Compare the replay's first event with the original one: the verdict and what supports it.
    ``traces``: every rank's {"rank", "trace", "notes"}."""
    original = incident.first_event
    same = {"kind": event is not None and event.kind == original.kind,
            "layer": event is not None and event.layer == original.layer,
            "step": event is not None and event.step == original.step}
    reproducible = all(same.values())
    notes = sorted({note for t in traces for note in t["notes"]})
    suspect = _suspect(incident, original)
    devices = suspect["device"]
    if not torch.cuda.is_available() and devices not in ("cpu", None):
        notes.append(f"replayed on the CPU: the original ran on {devices}; GPU kernels do not give"
                     " bit-identical results, so a fault of a GPU kernel may not show here")
    where = f"{original.kind} event in {original.layer or 'the loss'} at step {original.step}"
    if reproducible:
        message = (f"the same {where} happened again with the captured weights, batch and random"
                   " state: a deterministic bug in the model, the data or the code (see the trace)")
    elif event is None:
        message = (f"the step ran clean with the captured weights, batch and random state, so the "
                   f"original {where} did not recur: suspect a transient fault of the hardware that ran"
                   f" it (host {suspect['host']}, device {devices}, rank {original.rank}), or"
                   " non-determinism (atomics in kernels, inputs from outside the captured batch)")
    else:
        message = (f"the replay found a different first event ({event}) than the original {where}:"
                   f" suspect non-determinism or the hardware of host {suspect['host']}"
                   f" (device {devices}, rank {original.rank})")
    return {
        "verdict": "reproducible" if reproducible else "not_reproducible",
        "message": message,
        "incident": incident.name,
        "step": incident.step,
        "world_size": world,
        "original_event": original.to_dict(),
        "first_event": event.to_dict() if event is not None else None,
        "same": same,
        "suspects": [] if reproducible else [suspect],
        "trace": {str(t["rank"]): t["trace"] for t in traces},
        "notes": notes,
        "replayed": {"host": socket.gethostname(), "python": platform.python_version(),
                     "torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                     and torch.cuda.is_initialized() else "cpu",
                     "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
    }


def _suspect(incident: Incident, original: Event) -> dict[str, Any]:
    try:
        env = incident.environment(original.rank)
    except IncidentError:
        env = {}
    devices = env.get("devices") or []
    current = env.get("current_device")
    device = (devices[current] if isinstance(current, int) and 0 <= current < len(devices)
              else (", ".join(devices) if devices else "cpu"))
    return {"rank": original.rank, "host": env.get("host") or original.host or "?", "device": device}


def render(report: dict[str, Any], path: str | None) -> str:
    """The report as a few readable lines."""
    lines = [f"nanguard replay of {report['incident']} (step {report['step']}): {report['verdict']}",
             f"  {report['message']}",
             f"  original: {Event.from_dict(report['original_event'])}"]
    if report["first_event"] is not None:
        lines.append(f"  replayed: {Event.from_dict(report['first_event'])}")
    lines += ["  " + line for line in trace_lines(report)]
    lines += [f"  note: {note}" for note in report["notes"]]
    if path is not None:
        lines.append(f"  saved to {path}; `nanguard inspect {os.path.dirname(path)}` shows it")
    return "\n".join(lines)


def trace_lines(report: dict[str, Any], per_rank: int = 3) -> list[str]:
    """The first bad values the replay's synchronous trace met, per rank, forward then backward."""
    lines = []
    for rank, trace in sorted(report.get("trace", {}).items(), key=lambda kv: int(kv[0])):
        for entry in trace["forward"][:per_rank]:
            role = "producer" if entry["inputs_finite"] else "propagator"
            lines.append(f"rank {rank} forward: {entry['module'] or '<root>'} ({entry['module_type']},"
                         f" {role}, micro-batch {entry['micro_batch']}): {_stats(entry['output'])}")
        for entry in trace["gradients"][:per_rank]:
            lines.append(f"rank {rank} backward: gradient of {entry['gradient_of']}: {_stats(entry)}")
    return lines


def _stats(d: dict[str, Any]) -> str:
    return (f"{d.get('bad_count')} bad of shape {d.get('shape')}, first at {d.get('first_index')}"
            f" = {d.get('first_value')}")

