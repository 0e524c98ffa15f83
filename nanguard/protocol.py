"""The vocabulary that ranks, the coordinator, operators and incident files share, defined once.

Every side that speaks one of these words imports it from here: event kinds, the policies (a
rank's action on a non-finite value), why a job stopped, why a message was dropped, who a rank
says it is, and what a coordinator address looks like. No torch, no I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

from ._text import printable

# --- events ---------------------------------------------------------------------------------
STOP_KINDS = ("forward", "loss", "check", "backward", "grad", "buffer")
"""event kinds that stop a step"""
WARN_KINDS = ("grad_norm", "spike")
"""event kinds that only warn"""
KINDS = STOP_KINDS + WARN_KINDS
FIRST_EVENT_ORDER = {"forward": 0, "buffer": 1, "check": 1, "loss": 1, "backward": 2, "grad": 3}
"""which kind is the job's first event when several ranks saw something in one step: a forward
producer beats what it poisoned downstream (the loss, then the gradients)"""

# --- what a rank does about a non-finite value (``on_nan``; the ``action`` of its events) ---
Policy = Literal["raise", "skip", "warn"]
POLICIES: tuple[Policy, ...] = ("raise", "skip", "warn")
Mode = Literal["sentinel", "full"]
MODES: tuple[Mode, ...] = ("sentinel", "full")
"""what a guard checks on every step: ``sentinel``, only what the update depends on (the gradients,
the loss given to ``check``, the buffers the step wrote), and the full probes on a bad step alone
(the microscope); ``full``, every module's output on every step"""
VERDICTS_IN_JOB = ("reproducible", "device", "transient")
"""``Event.verdict``: bad again wherever re-run (the code or the data); bad again on its own device
and clean on a peer's (that device); clean when re-run on its own device (a transient)"""
OBSERVED = "observe"
"""the ``action`` of an event seen outside the training steps (an evaluation's forward, autograd
off, between optimizer steps): reported and counted, never acted on, and never a reason to stop"""
ACTIONS = POLICIES + (OBSERVED,)
"""what a rank did about an event it sends (the ``action`` of an ``events`` message)"""

# --- stops ----------------------------------------------------------------------------------
STOP_REASONS = ("nonfinite", "policy", "operator")
"""why a job stopped: a rank's own non-finite stop, the coordinator's policy, an operator (the
``reason`` of a rank's ``stopped`` message and of ``nanguard_stops_total``)"""
ORIGINS = ("policy", "operator")
"""who issued a stop command"""

# --- who may say what ------------------------------------------------------------------------
ROLES = ("rank", "operator")
"""whose credential authenticated a message: ``rank`` (NANGUARD_TOKEN) or ``operator``
(NANGUARD_OPERATOR_TOKEN, which ranks never hold)"""

# --- dropped messages -------------------------------------------------------------------------
WIRE_REASONS = ("oversized", "malformed", "version", "unauthenticated", "replayed", "stale", "schema",
                "instance")
"""why a message failed to decode (``ProtocolError.reason``); ``instance``: addressed to another
session (an earlier coordinator instance, another coordinator, another process), or to nobody"""
BAD_MESSAGE_REASONS = WIRE_REASONS + ("wrong_job", "unexpected", "unregistered", "forbidden",
                                      "out_of_range", "internal")
"""why the coordinator dropped a message (``nanguard_bad_message_reasons_total``): a wire reason;
``wrong_job``: another job (or another incarnation of it) while the current one has ranks alive;
``unexpected``: a type that does not travel to the coordinator; ``unregistered``: a rank message
from a process that has not said hello to this instance; ``forbidden``: a request the sender's
credential does not allow (a stop without the operator token); ``out_of_range``: a rank outside
its job's world size, or a world size over the coordinator's limit; ``internal``: the coordinator
failed on it (a bug, logged with its traceback)"""

# --- who a rank is (the body of its ``hello``) -------------------------------------------------
IDENTITY_FIELDS = ("rank", "local_rank", "world_size", "host", "pid", "job", "device", "version")
OPTIONAL_IDENTITY_FIELDS = ("restart",)
"""what a hello may add: ``restart``, TORCHELASTIC_RESTART_COUNT (which tells a torchrun restart of a
launch from a new launch of the same run id; ranks of earlier releases do not say it)"""
MAX_JOB_LENGTH = 128


def job_name(run_id: str | None) -> str:
    """The job a rank reports: TORCHELASTIC_RUN_ID, else "local". Characters the wire refuses
    (``printable``) are escaped; a run id too long for the wire keeps its start and gains a
    digest of the whole, so that two long ids still differ."""
    if not run_id:
        return "local"
    shown = printable(run_id)
    if len(shown) <= MAX_JOB_LENGTH:
        return shown
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{shown[:MAX_JOB_LENGTH - 17]}-{digest}"


# --- CurveZMQ keys (curve.py) ----------------------------------------------------------------
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


def check_curve_key(text: object, name: str) -> str:
    """``text`` when it is a Z85-encoded CurveZMQ key (40 characters); else ValueError naming ``name``."""
    if not isinstance(text, str) or not _Z85_KEY.fullmatch(text):
        raise ValueError(f"{name} must be a CurveZMQ key: 40 characters of Z85 text, as `nanguard keys` prints")
    return text


# --- addresses --------------------------------------------------------------------------------
_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+|\*):([0-9]{1,5}|\*)")
_ADDRESS_FORM = "tcp://host:port (port {lowest}-65535) or ipc:///path"


@dataclass(frozen=True, slots=True)
class Address:
    """A ZeroMQ endpoint: ``tcp://host:port``, ``ipc://path`` or ``inproc://name``."""

    scheme: str
    host: str
    """the host of a tcp address (without IPv6 brackets), else the path or name"""
    port: int | None
    """None for ipc and inproc, and for a wildcard port (``*``, binding only)"""

    @property
    def is_loopback(self) -> bool:
        """Only this machine can reach it: loopback TCP, ipc, inproc."""
        if self.scheme != "tcp":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # "*", an interface or a host name: reachable from elsewhere
            return False


def parse_address(text: object, *, bind: bool = False, label: str | None = None) -> Address:
    """Parse a coordinator address; ``bind`` also allows port 0 or ``*``, host ``*`` and
    ``inproc://name`` (one process only: nothing another process can connect to).

    Raises ValueError saying what an address must look like, about ``label`` (default:
    "coordinator address 'TEXT'").
    """
    lowest = 0 if bind else 1
    form = _ADDRESS_FORM.format(lowest=lowest)
    if label is None:
        label = f"coordinator address {text!r}"
    if not isinstance(text, str):
        raise ValueError(f"{label} must be a string like {form}")
    schemes = ("ipc", "inproc") if bind else ("ipc",)
    for scheme in schemes:
        prefix = f"{scheme}://"
        name = text[len(prefix):]
        if text.startswith(prefix) and name and not name.endswith("/") and name.isprintable():
            return Address(scheme, name, None)
    match = _TCP.fullmatch(text)
    if match is not None:
        host, port = match.group(1).strip("[]"), match.group(2)
        if (host != "*" or bind) and (port == "*" and bind or port != "*" and lowest <= int(port) <= 65535):
            return Address("tcp", host, None if port == "*" else int(port))
    raise ValueError(f"{label} must look like {form}")
