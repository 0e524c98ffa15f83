"""Settings: the one place that reads ``NANGUARD_*`` environment variables.

Precedence: keyword arguments to ``nanguard.init`` > environment > defaults. Every field can be
set from the environment as ``NANGUARD_<FIELD>`` (upper case); lists are comma-separated.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .protocol import MODES, POLICIES, Mode, Policy, check_curve_key, parse_address

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_DEVICE = re.compile(r"[a-z][a-z0-9_]*(:[0-9]+)?")  # torch.device's form; torch itself checks it later
_DATALESS_DEVICES = frozenset(("meta",))
"""device kinds whose tensors hold no values: nothing to replay on"""
_MAX_DETAIL_MB = float(2**20)
"""1 TiB: more than any device holds; a larger number overflows once made a count of bytes"""
_MAX_COUNT = 2**31 - 1
"""the largest count setting (ring and queue sizes, steps): Python's containers take no more"""
_OPTIONAL = frozenset(("grad_norm_warn", "replay_rank"))
"""number settings that may be None"""
_NUMBERS = {  # name: (the test of its lowest value, its highest, what it must be)
    "heartbeat_s": (lambda v: v >= 0.05, 3600.0, "a number of seconds in [0.05, 3600]"),
    "detail_mb": (lambda v: v >= 0, _MAX_DETAIL_MB, f"a number of MiB in [0, {_MAX_DETAIL_MB:.0f}]"),
    "grad_norm_warn": (lambda v: v > 0, sys.float_info.max, "a positive finite number or None"),
    "spike_factor": (lambda v: v > 1, sys.float_info.max, "a finite number above 1"),
}
"""the float settings: never a bool, never NaN (no comparison holds), never infinite"""
_COUNTS = {"max_events": 1, "max_pending": 1, "spike_warmup_steps": 1, "event_queue": 1, "flight_steps": 0,
           "replay_rank": 0}
"""the integer settings and their lowest value"""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE - {''})}")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_optional_float(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none", "off") else float(text)


def _parse_optional_bool(text: str) -> bool | None:
    return None if text.strip().lower() in ("", "none", "auto") else _parse_bool(text)


def _parse_optional_str(text: str) -> str | None:
    return text.strip() or None


def _parse_secret(text: str) -> str | None:
    """A shared secret: its HMAC key is its UTF-8 bytes. An environment variable whose bytes are not
    UTF-8 arrives with lone surrogates in their place (Python's ``surrogateescape``)."""
    secret = _parse_optional_str(text)
    if secret is not None:
        _check_secret(secret)
    return secret


def _check_secret(secret: str) -> None:
    try:
        secret.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("it holds bytes that are not UTF-8 text (set it to ASCII or UTF-8)") from None


def _parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else int(text)


def _setting(default: Any, parse, doc: str):
    return field(default=default, metadata={"parse": parse, "doc": doc, "secret": parse is _parse_secret})


@dataclass(kw_only=True, slots=True, frozen=True)
class Settings:
    """How a guard behaves. Field names are the ``init`` keywords and, upper-cased with a
    ``NANGUARD_`` prefix, the environment variables."""

    on_nan: Policy = _setting("raise", str.strip, "policy on a non-finite value: raise, skip or warn")
    mode: Mode = _setting(
        "sentinel", str.strip,
        "what is checked on every step: sentinel (what the update depends on; the full probes re-run only"
        " a bad step) or full (every module's output on every step)"
    )
    escalate: bool = _setting(
        True, _parse_bool, "under skip or warn, switch to full for the rest of the run after a fault that"
        " was not reproduced"
    )
    dir: str = _setting("nanguard-incidents", str.strip, "folder that incidents are written under")
    coordinator: str | None = _setting(None, _parse_optional_str, "coordinator address, tcp://host:port")
    token: str | None = _setting(None, _parse_secret, "the ranks' shared secret for coordinator messages")
    curve_public_key: str | None = _setting(
        None, _parse_optional_str,
        "the coordinator's CurveZMQ public key: encrypt the link, and talk only to the coordinator holding "
        "its secret key"
    )
    relay: bool = _setting(
        True, _parse_bool, "under torchrun, local rank 0 relays its node's ranks to the coordinator over one"
        " connection (off: a connection per rank)"
    )
    heartbeat_s: float = _setting(2.0, float, "seconds between heartbeats to the coordinator")
    event_queue: int = _setting(
        1024, int, "events held for the coordinator's sender thread; more are dropped and counted"
    )
    replay: str | None = _setting(None, _parse_optional_str, "incident folder to replay")
    replay_device: str | None = _setting(
        None, _parse_optional_str,
        "device a replay runs the model on (cpu, cuda:3); default: where the script puts it"
    )
    replay_rank: int | None = _setting(
        None, _parse_optional_int,
        "rank whose part a one-process replay of a multi-rank incident runs; default: the first event's"
    )
    replay_ops: bool = _setting(
        True, _parse_bool, "a replay checks every ATen operation of its step (slower; off: modules only)"
    )
    sample_id_key: str | None = _setting(
        None, _parse_optional_str, "key or keyword of the model's input that holds sample ids (replay)"
    )
    disable: bool = _setting(False, _parse_bool, "install nothing; init returns an inert guard")
    capture: bool | None = _setting(
        None, _parse_optional_bool,
        "write an incident folder when a step is stopped: None on raise, True on skip too, False never"
    )
    capture_batch: bool = _setting(True, _parse_bool, "write the step's input batches into incidents")
    max_events: int = _setting(256, int, "size of the in-memory ring of recent events")
    max_pending: int = _setting(
        65536, int, "checks held between two decisions before they are settled early (bounds memory)"
    )
    detail_mb: float = _setting(
        64.0, float, "MiB of the step's first checked tensors kept for an exact report (0: none)"
    )
    grad_norm_warn: float | None = _setting(
        None, _parse_optional_float, "warn when the total gradient norm exceeds this"
    )
    spike_factor: float = _setting(
        10.0, float, "warn when the gradient norm exceeds this many times its running level"
    )
    spike_warmup_steps: int = _setting(10, int, "clean steps before the spike detector arms")
    flight_steps: int = _setting(
        1000, int, "steps of per-step scalars (loss, gradient norms, scale, lr) incidents keep; 0: none"
    )
    param_grad_norms: bool = _setting(
        False, _parse_bool, "read every parameter's gradient norm each step (more detail, a bigger read)"
    )
    skip_types: tuple[str, ...] = _setting(
        (), _parse_list, "module class names whose outputs may be non-finite on purpose"
    )
    skip_modules: tuple[str, ...] = _setting(
        (), _parse_list, "module name patterns (fnmatch) whose outputs may be non-finite on purpose"
    )

    def __post_init__(self) -> None:
        if self.on_nan not in POLICIES:
            raise ConfigError(f"on_nan={self.on_nan!r} is not one of {', '.join(POLICIES)}")
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {', '.join(MODES)}")
        if not isinstance(self.dir, str) or not self.dir:
            raise ConfigError(f"dir={self.dir!r} must be a non-empty path")
        for name in ("token", "replay", "sample_id_key"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ConfigError(f"{name}={value!r} must be a non-empty string or None")
        if self.token is not None:
            try:
                _check_secret(self.token)
            except ValueError as exc:
                raise ConfigError(f"token: {exc}") from None
        if self.coordinator is not None:
            try:
                parse_address(self.coordinator, label=f"coordinator={self.coordinator!r}")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.curve_public_key is not None:
            try:
                check_curve_key(self.curve_public_key, "curve_public_key")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for name, (lowest, highest, what) in _NUMBERS.items():
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL or _is_number(value) and lowest(value) and value <= highest):
                raise ConfigError(f"{name}={value!r} must be {what}")
        for name, lowest in _COUNTS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= _MAX_COUNT:
                raise ConfigError(f"{name}={value!r} must be an integer in [{lowest}, {_MAX_COUNT}]")
        if self.capture not in (None, True, False):
            raise ConfigError(f"capture={self.capture!r} must be None, True or False")
        self._check_replay_device()
        for name in ("disable", "escalate", "param_grad_norms", "capture_batch", "replay_ops"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        for name, what in (("skip_types", "module class names or classes"),
                           ("skip_modules", "module name patterns")):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, (str, type)) for v in value):
                raise ConfigError(f"{name}={value!r} must be a list of {what}")

    def _check_replay_device(self) -> None:
        device = self.replay_device
        if device is None:
            return
        if not (isinstance(device, str) and _DEVICE.fullmatch(device)):
            raise ConfigError(f"replay_device={device!r} must name a device such as cpu or cuda:3")
        if device.split(":")[0] in _DATALESS_DEVICES:
            raise ConfigError(f"replay_device={device!r} holds no data: replay on cpu, cuda or cuda:N")

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from keyword overrides, else ``NANGUARD_*`` variables, else defaults."""
        environ = os.environ if environ is None else environ
        overrides = dict(overrides or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ConfigError(
                f"unknown nanguard setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}"
            )
        values: dict[str, Any] = {}
        from_env: list[str] = []
        for name, f in fields.items():
            if name in overrides:
                value = overrides[name]
                if name in ("skip_types", "skip_modules") and isinstance(value, (list, set, frozenset)):
                    value = tuple(value)
                values[name] = value
                continue
            value = _from_env(f, environ)
            if value is not _UNSET:
                values[name] = value
                from_env.append(_variable(name))
        try:
            return cls(**values)
        except ConfigError as exc:
            if not from_env:
                raise
            raise ConfigError(f"{exc} (environment variables in use: {', '.join(from_env)})") from None


@dataclass(kw_only=True, slots=True, frozen=True)
class _DaemonSettings:
    """Variables that only the coordinator and operator commands read, never a guard: secrets that
    a training process must not hold."""

    operator_token: str | None = _setting(
        None, _parse_secret, "the operators' secret: stopping a job needs it; never give it to ranks"
    )
    curve_secret_key: str | None = _setting(
        None, _parse_optional_str, "the coordinator's CurveZMQ secret key (give it to the coordinator only)"
    )


_CURVE_KEYS = ("curve_public_key", "curve_secret_key")


def setting_from_env(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from its ``NANGUARD_*`` variable, else its default; also the daemon's own
    ``operator_token`` and ``curve_secret_key``.

    For the coordinator daemon and the operator commands, which need only the address or the
    secrets: a bad value of a guard-only variable (``NANGUARD_ON_NAN``...) must not stop them.
    """
    fields = {f.name: f for cls in (Settings, _DaemonSettings) for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ConfigError(f"unknown nanguard setting {name!r}; valid: {', '.join(sorted(fields))}")
    value = _from_env(fields[name], os.environ if environ is None else environ)
    if value is _UNSET:
        return fields[name].default
    if name in _CURVE_KEYS and value is not None:
        try:
            check_curve_key(value, _variable(name))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return value


_UNSET = object()


def _variable(name: str) -> str:
    return "NANGUARD_" + name.upper()


def _from_env(f: dataclasses.Field, environ: Mapping[str, str]) -> Any:
    """The field's value parsed from its ``NANGUARD_*`` variable; ``_UNSET`` when it is not set."""
    variable = _variable(f.name)
    if variable not in environ:
        return _UNSET
    try:
        return f.metadata["parse"](environ[variable])
    except ValueError as exc:
        shown = variable if f.metadata["secret"] else f"{variable}={environ[variable]!r}"  # (no secret in a log)
        raise ConfigError(f"{shown} is invalid: {exc}") from None
