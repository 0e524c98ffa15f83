"""A guard's own state, for checkpoints: a resumed run goes on counting where it left off, as every
checkpointed PyTorch object does (``Guard.state_dict()`` / ``Guard.load_state_dict()``)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from .clock import StepClock
from .respond import Responder

VERSION = 1


def state_dict(clock: StepClock, respond: Responder) -> dict[str, Any]:
    norms = respond.norms
    return {"version": VERSION, "step": clock.step, "skipped_steps": respond.skipped_steps,
            "grad_norm_level": norms.level, "grad_norm_ordinary_steps": norms.ordinary_steps}


def load_state_dict(state: Any, clock: StepClock, respond: Responder, keep_step: bool = False) -> None:
    """Check all of ``state`` first (it comes from a file), then load it; ConfigError names what is
    wrong and nothing is loaded. Only "step" is required (a trainer's global step). ``keep_step``:
    the clock stays where it is (a replay counts from its incident's step)."""
    if not isinstance(state, dict) or "step" not in state:
        raise ConfigError(f"Guard.load_state_dict: expected a dict from Guard.state_dict() (at least "
                          f"'step'), got {type(state).__name__}; nothing was loaded")
    counts = {key: state.get(key, default) for key, default in (
        ("step", None), ("skipped_steps", respond.skipped_steps),
        ("grad_norm_ordinary_steps", respond.norms.ordinary_steps))}
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"Guard.load_state_dict: {key}={value!r} must be an integer >= 0;"
                              " nothing was loaded")
    level = state.get("grad_norm_level", respond.norms.level)
    if level is not None and (isinstance(level, bool) or not isinstance(level, (int, float))
                              or not math.isfinite(level) or level < 0):
        raise ConfigError(f"Guard.load_state_dict: grad_norm_level={level!r} must be a finite number"
                          " >= 0 or None; nothing was loaded")
    if state.get("version", VERSION) != VERSION:
        raise ConfigError(f"Guard.load_state_dict: state version {state.get('version')!r} is not"
                          f" {VERSION}; nothing was loaded")
    if not keep_step:
        clock.step = clock.index = counts["step"]
    respond.skipped_steps = counts["skipped_steps"]
    respond.norms.ordinary_steps = counts["grad_norm_ordinary_steps"]
    respond.norms.level = None if level is None else float(level)
