"""The device a replay runs on, the device that saw the incident, and what comparing them says.

``NANGUARD_REPLAY_DEVICE`` puts the model (its captured state) and the captured batch on another
device; the model's outputs go back to the device the script put the model on, so the script's
own loss code runs unchanged. Bad on the original device and clean elsewhere points at that
device; bad everywhere points at the code or the data.
"""

from __future__ import annotations

import platform
import socket
from typing import Any

import torch
from torch import nn

from .._tree import map_tensors
from ..errors import IncidentError, NanguardError
from ..events import Event
from ..incident import Incident
from ..rank.modules import is_wrapper, unwrap

MAX_HISTORY = 16  # earlier replays of an incident kept in its report
# wrappers that hold state on the device they were built on (buckets, flat parameters)
_DEVICE_BOUND = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def parse(text: str | None) -> torch.device | None:
    if text is None:
        return None
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise NanguardError(f"NANGUARD_REPLAY_DEVICE={text!r} is not a device torch knows ({exc});"
                            " use cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NanguardError(f"NANGUARD_REPLAY_DEVICE={text!r}: this machine has no CUDA device;"
                            " use cpu, or replay where a GPU is")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise NanguardError(f"NANGUARD_REPLAY_DEVICE={text!r}: this machine has "
                            f"{torch.cuda.device_count()} GPU(s), numbered from 0")
    return device


def device_of(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def move(root: nn.Module, device: torch.device) -> torch.device | None:
    """Moves the model inside ``root`` to ``device``; returns the device it was on (where the
    script expects the model's outputs), or None when it is already there."""
    script_device = device_of(root)
    if _same(script_device, device):
        return None
    if is_wrapper(root) and type(root).__name__ in _DEVICE_BOUND:
        raise NanguardError(f"NANGUARD_REPLAY_DEVICE={device}: the model is wrapped in "
                            f"{type(root).__name__}, which keeps its state on {script_device} where it "
                            "was built; nothing was moved. Replay one rank alone without the wrapper, or "
                            f"run the script with {device} as its own device (CUDA_VISIBLE_DEVICES)")
    unwrap(root).to(device)
    return script_device


def outputs_to(device: torch.device):
    """A forward hook that hands the model's outputs back on ``device`` (the script's)."""
    def hook(module, args, output):
        return map_tensors(output, lambda t: t.to(device))

    return hook


def _same(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


# ---------------------------------------------------------------------- who is who
def original(incident: Incident, rank: int, event: Event) -> dict[str, Any]:
    """The device that ran ``rank`` in the incident, from its environment.json."""
    try:
        env = incident.environment(rank)
    except IncidentError:
        env = {}
    names = env.get("devices") or []
    current = env.get("current_device")
    uuids = env.get("device_uuids") or []
    known = isinstance(current, int) and 0 <= current < len(names)
    return {"rank": rank, "host": env.get("host") or event.host or "?",
            "device": f"cuda:{current}" if known else "cpu", "name": names[current] if known else "cpu",
            "uuid": uuids[current] if known and current < len(uuids) else None}


def this_one(device: torch.device) -> dict[str, Any]:
    """The device this replay ran the model on, with its UUID and serial when CUDA can tell."""
    record: dict[str, Any] = {"host": socket.gethostname(), "device": str(device),
                              "name": platform.processor() or platform.machine() or "cpu",
                              "uuid": None, "serial": None}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        record.update(device=f"cuda:{index}", name=props.name,
                      uuid=None if uuid is None else f"GPU-{uuid}")
        record["serial"] = _serial(record["uuid"])
    return record


def _serial(uuid: str | None) -> str | None:
    """The board serial NVML reports for a GPU, when nvidia-ml-py is installed."""
    if uuid is None:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            serial = pynvml.nvmlDeviceGetSerial(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None  # no NVML driver, or a GPU without a serial (GeForce boards have none)
    return serial.decode() if isinstance(serial, bytes) else str(serial)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two device records name one device: by UUID where both have one, else by host and device."""
    if a.get("uuid") and b.get("uuid"):
        return a["uuid"] == b["uuid"]
    return a.get("host") == b.get("host") and a.get("device") == b.get("device")


def label(record: dict[str, Any]) -> str:
    name = record.get("name")
    text = str(record.get("device")) + (f" ({name})" if name and record.get("device") != "cpu" else "")
    text += f" on host {record.get('host')}"
    if record.get("uuid"):
        text += f", {record['uuid']}"
    if record.get("serial"):
        text += f", serial {record['serial']}"
    return text


# ---------------------------------------------------------------------- the comparison
_NUMERICS = ("CPU and GPU kernels round differently (summation order, TF32 or reduced-precision matmuls,"
             " fused kernels) and draw different random numbers, so a value at the edge of the float range"
             " or a NaN that a random draw made may appear on one and not the other")


def compare(original: dict[str, Any], runs: list[dict[str, Any]], near_limit: bool) -> dict[str, Any]:
    """What the replays of an incident say of the device that saw it. ``runs``: every replay's
    device record with ``bad`` (its step went non-finite), this one last; ``near_limit``: the
    original bad value came near the float limit (numeric differences alone may explain it)."""
    here = runs[-1]
    elsewhere = [r for r in runs if not same(original, r)]
    bad_elsewhere = [r for r in elsewhere if r["bad"]]
    clean_elsewhere = [r for r in elsewhere if not r["bad"]]
    bad_on_original = [r for r in runs if same(original, r) and r["bad"]]
    where = label(original)
    if same(original, here) and not here["bad"] and bad_on_original:
        # never "bad again" of a replay that ran clean: the script may have been mended since the earlier one
        finding, message = "undecided", (f"clean on the original device, {where}, this time; an earlier replay"
                                         " there was bad: the code or the data changed since, or the fault comes"
                                         " and goes")
    elif bad_elsewhere:
        finding, message = "code_or_data", (f"bad on the original device and again on {label(bad_elsewhere[-1])}"
                                            f"{'' if bad_elsewhere[-1] is here else ' (an earlier replay)'}: the code or the"
                                            " data, not the device")
    elif clean_elsewhere and bad_on_original:
        finding, message = "device", (f"bad again on the original device, {where}, and clean on "
                                      f"{label(clean_elsewhere[-1])}: that device is at fault")
    elif clean_elsewhere:
        finding, message = "device", (f"bad only on the original device, {where}, and clean on "
                                      f"{label(clean_elsewhere[-1])}: suspect that device (a fault of its own,"
                                      " or a transient one: a replay on it again tells them apart)")
    elif bad_on_original:
        other = ("a GPU, or another host" if original.get("device") == "cpu"
                 else "NANGUARD_REPLAY_DEVICE=cpu, or another GPU")
        finding, message = "undecided", (f"bad again on the original device, {where}: the code, the data or"
                                         f" that device; replay on another device ({other}) to tell them apart")
    else:
        finding, message = "undecided", (f"clean on the original device, {where}: a transient fault or"
                                         " non-determinism; a replay on another device adds nothing here")
    kinds = {original.get("device", "").split(":")[0]} | {r["device"].split(":")[0] for r in clean_elsewhere}
    if finding == "device" and len(kinds) > 1:
        message += f"; but {_NUMERICS}" + (
            ", and the original bad value came near the float limit, so numerics alone may explain it"
            if near_limit else "")
    return {"original": original, "replayed": here, "same_device": same(original, here),
            "finding": finding, "message": message, "replays": runs[-MAX_HISTORY:]}


def earlier_runs(report: Any) -> list[dict[str, Any]]:
    """The device records of earlier replays, from the incident's previous report (untrusted:
    whatever does not look like one is left out)."""
    devices = report.get("devices") if isinstance(report, dict) else None
    runs = devices.get("replays") if isinstance(devices, dict) else None
    if not isinstance(runs, list):
        return []
    keys = ("host", "device", "name")
    return [r for r in runs if isinstance(r, dict) and isinstance(r.get("bad"), bool)
            and all(isinstance(r.get(k), str) for k in keys)][-(MAX_HISTORY - 1):]
