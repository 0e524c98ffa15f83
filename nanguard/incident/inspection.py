"""``nanguard inspect DIR``: what an incident says, read without the training code.

Reads only the manifest and the JSON files (and checks every file's sha256); never unpickles
a state or a batch, so it runs anywhere torch is installed, on any incident. The flight recorder
(flight.json), when the incident has one, is drawn as sparklines, or with ``--plot FILE.png``
as an image (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import IncidentError
from ..events import Event
from .._text import printable
from . import flight_chart
from .fsio import plain
from .manifest import FLIGHT
from .reader import Incident, read_incident
from .replay_lines import detail_lines, trace_lines

_LABEL = 13  # width of the summary's left column


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def _role(event: Event) -> str:
    """Producer or passed on: did the layer make the value, or only pass on a bad input?"""
    if event.input_nonfinite is None:
        return "unknown (its inputs were not checked)"
    if event.input_nonfinite:
        return "passed on: its inputs were already non-finite; the cause lies upstream"
    return "producer: its inputs were finite and its output is not; the value was made here"


def as_json(incident: Incident) -> dict[str, Any]:
    """One JSON-ready object: the incident, its first event, the files per rank and the replay."""
    manifest = incident.manifest
    return {
        "incident": incident.name,
        "path": incident.path,
        "step": incident.step,
        "world_size": incident.world_size,
        "created": manifest.get("created"),
        "first_event": incident.first_event.to_dict(),
        "capture_batch": manifest["capture_batch"],
        "sharded": manifest["sharded"],
        "notes": manifest.get("notes") or {},
        "ranks": [{"rank": r["rank"], "files": r["files"]} for r in manifest["ranks"]],
        "replay": incident.replay_report(),
        "flight": {str(rank): _flight_json(incident, rank) for rank in _flight_ranks(incident)},
    }


def _flight_ranks(incident: Incident) -> list[int]:
    return [r["rank"] for r in incident.manifest["ranks"]
            if f"rank{r['rank']}/{FLIGHT}" in r["files"]]


def _flight_json(incident: Incident, rank: int) -> dict[str, Any]:
    try:
        recorded = read_flight(incident, rank)
    except flight_chart.FlightError as exc:
        return {"problem": str(exc)}
    return plain({"columns": recorded.columns, "rows": recorded.rows, "top_params": recorded.top_params})


def read_flight(incident: Incident, rank: int) -> flight_chart.Flight | None:
    """Rank ``rank``'s flight recorder, checked; None when it has none; FlightError (naming the
    file) when it is malformed."""
    try:
        data = incident.rank_flight(rank)
    except IncidentError as exc:
        raise flight_chart.FlightError(exc.reason) from exc
    if data is None:
        return None
    try:
        return flight_chart.parse(data)
    except flight_chart.FlightError as exc:
        raise flight_chart.FlightError(f"rank{rank}/{FLIGHT} is malformed: {exc}") from exc


def summary(incident: Incident) -> str:
    """A few readable lines: where it happened, who made the value, the replay verdict, the files."""
    data = as_json(incident)
    event = incident.first_event
    where = f"rank {event.rank}" + (f" on {event.host}" if event.host else "")
    if event.micro_batch is not None:
        where += f", micro-batch {event.micro_batch}"
    lines = [
        f"incident     {data['incident']}  ({data['path']})",
        f"step         {data['step']}, world size {data['world_size']}, captured {data['created']}",
        f"first seen   by {where}",
        f"kind         {event.kind}",
        f"layer        {event.layer or 'the model'}" + (f" ({event.module_type})" if event.module_type else ""),
        f"role         {_role(event)}",
        f"values       {event.detail()}",
    ]
    replay = data["replay"]
    if replay is None:
        lines.append(f"replay       not run yet (run the same script with NANGUARD_REPLAY={data['path']})")
    else:
        text = f"replay       {replay.get('verdict')}"
        replayed = replay.get("first_event")
        if replayed is None:
            text += ": no non-finite value the second time"
        else:
            try:
                text += f": {Event.from_dict(replayed)}"
            except ValueError:  # ProtocolError: the report is ours, but say so rather than fail
                text += ": (the replayed first event is not readable)"
        lines.append(text)
        if replay.get("message"):
            lines.append(f"             {replay['message']}")
        try:
            lines += [f"trace        {line}" for line in trace_lines(replay, per_rank=2)]
            lines += [f"{label:<{_LABEL - 1}} {text}" for label, text in detail_lines(replay)]
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            lines.append("trace        (not readable in this report)")
    if data["sharded"]:
        lines.append(f"sharded      {data['sharded']}")
    if not data["capture_batch"]:
        lines.append("batches      not captured (capture_batch=False): a replay needs the data again")
    for key, value in data["notes"].items():
        lines.append(f"note         {key}: {value}")
    lines += flight_lines(incident)
    for r in data["ranks"]:
        files = ", ".join(f"{path.split('/', 1)[1]} {_size(entry['size'])}"
                          for path, entry in r["files"].items())
        lines.append(f"rank {r['rank']:<7} {files}")
    # every line holds what a folder, maybe crafted, says: nothing in it may act on the terminal
    return "\n".join(printable(line) for line in lines)


def flight_lines(incident: Incident) -> list[str]:
    """The first event's rank's flight recorder (or the first rank's that has one), drawn."""
    ranks = _flight_ranks(incident)
    if not ranks:
        return []
    first = incident.first_event.rank
    rank = first if first in ranks else ranks[0]
    try:
        recorded = read_flight(incident, rank)
    except flight_chart.FlightError as exc:
        return [f"{'flight':<{_LABEL}}not drawn: {exc}"]
    others = f"; ranks with one: {', '.join(map(str, ranks))}" if len(ranks) > 1 else ""
    whose = " (the first event's)" if rank == first else ""
    head = f"{'flight':<{_LABEL}}rank {rank}{whose}: {len(recorded.rows)} step(s) recorded{others}"
    return [head] + flight_chart.lines(recorded, incident.step, indent=2)


def _plot(incident: Incident, path: str) -> str | None:
    """Draws the flight recorder into ``path``; returns what went wrong, or None."""
    ranks = _flight_ranks(incident)
    if not ranks:
        return "this incident has no flight recorder (flight.json): nothing to plot"
    rank = incident.first_event.rank if incident.first_event.rank in ranks else ranks[0]
    try:
        recorded = read_flight(incident, rank)
        flight_chart.plot(recorded, incident.step, f"{incident.name}: rank {rank}", path)
    except flight_chart.FlightError as exc:
        return f"not plotted: {exc}"
    except ImportError:
        return "--plot needs matplotlib: pip install 'nanguard[plot]'"
    except OSError as exc:
        return f"{path}: could not be written ({exc.strerror or exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    """``nanguard inspect DIR [--json] [--plot FILE.png]``: 0 on success, 2 on a missing, partial or
    damaged incident, 1 when the plot could not be drawn (the summary is printed all the same)."""
    parser = argparse.ArgumentParser(prog="nanguard inspect", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("dir", metavar="DIR", help="an incident folder (under NANGUARD_DIR)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the flight recorder into an image (matplotlib)")
    args = parser.parse_args(argv)
    try:
        incident = read_incident(args.dir)
        text = json.dumps(as_json(incident), allow_nan=False) if args.json else summary(incident)
    except IncidentError as err:
        print(f"nanguard inspect: {printable(err.path)}: {printable(err.reason)}", file=sys.stderr)
        return 2
    print(text)
    problem = _plot(incident, args.plot) if args.plot else None
    if problem is not None:
        print(f"nanguard inspect: {printable(problem)}", file=sys.stderr)
        return 1
    if args.plot and not args.json:
        print(f"{'plot':<{_LABEL}}{args.plot}")
    return 0
