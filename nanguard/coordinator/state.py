"""The coordinator's state file: the standing stop of the job it serves, so that a coordinator
started again (after a crash, a full disk, a rescheduled pod) stops that job's ranks again as they
reconnect, instead of letting a stopped job run on.

    {"version": 1, "job": <job id>, "world_size": <int>, "restart": <int> or null,
     "stop": {"command_id", "origin", "reason", "time", "counted_as", "job", "restart"} or null}

``restart`` is the restart count of the launch served, the stop's ``job`` and ``restart`` the
incarnation it stopped (files of earlier releases have neither: a launch is then not told from a
restart, and the stop holds). It is written each time the job's stop or the launch served changes
(a stop is decided or lifted; a new job, launch or torchrun restart registers),
atomically: a temporary file beside it, fsynced, renamed over it, and the folder fsynced, so a crash
leaves the old state or the new one, never half of one. It is read back and checked at start; a
file that is not one is said in one line and left out (the coordinator starts without a standing
stop, and the next stop replaces the file).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from ..errors import ProtocolError
from ..wire import MAX_RANK, check_body
from .stop import StopCommand

STATE_VERSION = 1
_MAX_STATE_BYTES = 64 * 1024


class StateError(ValueError):
    """The state file is not one this coordinator wrote: what is wrong, and where."""


class SavedState(NamedTuple):
    job: str | None
    world_size: int | None
    stop: StopCommand | None
    restart: int | None = None
    """the restart count of the launch served (None: its ranks did not say it)"""


def write_state(path: str, state: SavedState) -> None:
    """Replace the file at ``path`` by ``state``, atomically; raises OSError."""
    stop = state.stop.status() if state.stop is not None else None
    if stop is not None:
        del stop["acked"]  # a new instance's ranks ack anew
    data = json.dumps({"version": STATE_VERSION, "job": state.job, "world_size": state.world_size,
                       "restart": state.restart, "stop": stop}, separators=(",", ":")).encode() + b"\n"
    temporary = f"{path}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_state(path: str) -> SavedState | None:
    """The state saved at ``path``, or None when there is no such file; raises StateError saying
    what is wrong with a file that is there."""
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read the state file {path}: {exc.strerror or exc}") from None
    if len(data) > _MAX_STATE_BYTES:
        raise StateError(f"the state file {path} is over {_MAX_STATE_BYTES} bytes: not one the coordinator wrote")
    try:
        return _checked(json.loads(data))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise StateError(f"the state file {path} is not a nanguard coordinator state: {str(exc)[:200]}") from None


def _checked(data: Any) -> SavedState:
    """The state in ``data`` (parsed JSON); ValueError saying what is wrong."""
    if not isinstance(data, dict) or set(data) - {"restart"} != {"version", "job", "world_size", "stop"}:
        raise ValueError("expected an object of version, job, world_size, stop and (optional) restart")
    if data["version"] != STATE_VERSION:
        raise ValueError(f"version {json.dumps(data['version'])[:20]}, where this coordinator reads {STATE_VERSION}")
    world_size, restart = data["world_size"], data.get("restart")
    if restart is not None and (restart.__class__ is not int or restart < 0):
        raise ValueError(f"restart {json.dumps(restart)[:20]} is not a non-negative integer")
    if world_size is not None and (world_size.__class__ is not int or not 1 <= world_size <= MAX_RANK):
        raise ValueError(f"world_size {json.dumps(world_size)[:20]} is not an integer in [1, {MAX_RANK}]")
    stop = data["stop"]
    if stop is not None and not isinstance(stop, dict):
        raise ValueError("bad field.stop: expected an object or null")
    try:  # the job and the stop, by the rules a status reply's are checked by
        checked = check_body("status", {"job": data["job"], "ranks": [],
                                        "stop": None if stop is None else {**stop, "acked": []}})
    except ProtocolError as exc:
        raise ValueError(str(exc).replace("bad status message body", "bad field")) from None
    if checked["stop"] is None:
        return SavedState(checked["job"], world_size, None, restart)
    if checked["job"] is None or world_size is None:
        raise ValueError("a stop without the job and world size it stopped")
    stop = checked["stop"]
    command = StopCommand(stop["command_id"], stop["origin"], stop["reason"], stop["time"],
                          stop.get("counted_as", "policy"), job=stop.get("job", checked["job"]),
                          restart=stop.get("restart", restart))
    return SavedState(checked["job"], world_size, command, restart)
