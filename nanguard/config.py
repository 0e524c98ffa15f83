"""Settings: the one place that reads ``NANGUARD_*`` environment variables.

Precedence: keyword arguments to ``nanguard.init`` > environment > defaults. Every field can be
set from the environment as ``NANGUARD_<FIELD>`` (upper case); lists are comma-separated.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .protocol import POLICIES, Policy, check_curve_key, parse_address

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_DEVICE = re.compile(r"[a-z][a-z0-9_]*(:[0-9]+)?")  # torch.device's form; torch itself checks it later


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


def _parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else int(text)


def _setting(default: Any, parse, doc: str):
    return field(default=default, metadata={"parse": parse, "doc": doc})


@dataclass(kw_only=True, slots=True, frozen=True)
class Settings:
    """How a guard behaves. Field names are the ``init`` keywords and, upper-cased with a
    ``NANGUARD_`` prefix, the environment variables."""

    on_nan: Policy = _setting("raise", str.strip, "policy on a non-finite value: raise, skip or warn")
    dir: str = _setting("nanguard-incidents", str.strip, "folder that incidents are written under")
    coordinator: str | None = _setting(None, _parse_optional_str, "coordinator address, tcp://host:port")
    token: str | None = _setting(None, _parse_optional_str, "the ranks' shared secret for coordinator messages")
    curve_public_key: str | None = _setting(
        None, _parse_optional_str,
        "the coordinator's CurveZMQ public key: encrypt the link, and talk only to the coordinator holding "
        "its secret key"
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
        if not isinstance(self.dir, str) or not self.dir:
            raise ConfigError(f"dir={self.dir!r} must be a non-empty path")
        if self.coordinator is not None:
            try:
                parse_address(self.coordinator)
            except ValueError as exc:
                raise ConfigError(str(exc).replace("coordinator address ", "coordinator=", 1)) from None
        if self.curve_public_key is not None:
            try:
                check_curve_key(self.curve_public_key, "curve_public_key")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if not (isinstance(self.heartbeat_s, (int, float)) and 0.05 <= self.heartbeat_s <= 3600):
            raise ConfigError(f"heartbeat_s={self.heartbeat_s!r} must be a number of seconds in [0.05, 3600]")
        if isinstance(self.flight_steps, bool) or not isinstance(self.flight_steps, int) or self.flight_steps < 0:
            raise ConfigError(f"flight_steps={self.flight_steps!r} must be an integer >= 0")
        for name in ("max_events", "max_pending", "spike_warmup_steps", "event_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if not (isinstance(self.detail_mb, (int, float)) and 0 <= self.detail_mb < math.inf):
            raise ConfigError(f"detail_mb={self.detail_mb!r} must be a number of MiB, 0 or more")
        if self.grad_norm_warn is not None and not (
            isinstance(self.grad_norm_warn, (int, float)) and self.grad_norm_warn > 0
            and math.isfinite(self.grad_norm_warn)
        ):
            raise ConfigError(f"grad_norm_warn={self.grad_norm_warn!r} must be a positive number or None")
        if not (isinstance(self.spike_factor, (int, float)) and self.spike_factor > 1
                and math.isfinite(self.spike_factor)):
            raise ConfigError(f"spike_factor={self.spike_factor!r} must be a number above 1")
        if self.capture not in (None, True, False):
            raise ConfigError(f"capture={self.capture!r} must be None, True or False")
        self._check_replay()
        for name in ("disable", "param_grad_norms", "capture_batch", "replay_ops"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("skip_types", "skip_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, (str, type)) for v in value):
                raise ConfigError(f"{name}={value!r} must be a list of names")

    def _check_replay(self) -> None:
        if self.replay_device is not None and not (
                isinstance(self.replay_device, str) and _DEVICE.fullmatch(self.replay_device)):
            raise ConfigError(f"replay_device={self.replay_device!r} must name a device such as cpu or cuda:3")
        if self.replay_rank is not None and (isinstance(self.replay_rank, bool) or not isinstance(
                self.replay_rank, int) or self.replay_rank < 0):
            raise ConfigError(f"replay_rank={self.replay_rank!r} must be a rank (0 or more) or None")
        if self.sample_id_key is not None and not (isinstance(self.sample_id_key, str) and self.sample_id_key):
            raise ConfigError(f"sample_id_key={self.sample_id_key!r} must be a non-empty name or None")

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
                if name in ("skip_types", "skip_modules") and isinstance(value, (list, set)):
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
        None, _parse_optional_str, "the operators' secret: stopping a job needs it; never give it to ranks"
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
        raise ConfigError(f"{variable}={environ[variable]!r} is invalid: {exc}") from None
