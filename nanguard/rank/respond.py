"""What a guard does once a step is decided: the ``on_nan`` policy for the job's first event
(report, capture an incident, skip the update or raise), a requested stop, and the warnings of
the gradient-norm monitor."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import capture
from .._dist import Collectives, RankInfo
from ..capture import IncidentError
from ..config import Settings
from ..errors import NonFiniteError, StopRequested
from ..events import Event, EventLog
from .decision import params
from .detector import Detector
from .diagnose import Finding
from .gradnorm import GradNormMonitor
from .modules import sharding, unwrap
from .reporter import Reporter

log = logging.getLogger("nanguard")



def _action(policy: str, world: int, stepping: bool) -> str:
    """What this rank does, for the report."""
    if policy == "warn":
        return "continuing (on_nan=warn)"
    if not stepping:
        return "stopping" if policy == "raise" else "continuing (no optimizer step to skip)"
    if policy == "raise":
        return "stopping all ranks before the optimizer step" if world > 1 else "stopping before the optimizer step"
    return "skipping this update" + (" on all ranks" if world > 1 else "")


class Responder:
    """Acts on decided steps for one guard. ``capture_inputs()`` gives what an incident holds
    besides the optimizer: (model, the step's batches, the RNG at the step's start)."""

    def __init__(self, settings: Settings, identity: RankInfo, group: Collectives, reporter: Reporter,
                 events: EventLog, states: dict[str, Any], on_stop: Callable[[Exception], Any] | None,
                 capture_inputs: Callable[[], tuple[nn.Module | None, list, dict]],
                 param_name: Callable[[torch.Tensor], str]):
        self.settings = settings
        self.identity = identity
        self.group = group
        self.reporter = reporter
        self.events = events
        self.states = states
        self.on_stop = on_stop
        self.capture_inputs = capture_inputs
        self.param_name = param_name
        self.incident: str | None = None
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_param_grad_norms: dict[str, float] = {}
        self.norms = GradNormMonitor(settings.grad_norm_warn, settings.spike_factor,
                                     settings.spike_warmup_steps)

    def note(self, finding: Finding, action: str) -> None:
        """Keep an event; send it to the coordinator when this rank is the one that saw it (values
        another rank sent through the all-reduce are that rank's event, not this one's)."""
        self.events.add(finding.event)
        if finding.event.rank == self.group.rank and finding.born_here:
            self.reporter.note(finding.event, action)

    def act(self, event: Event, optimizer: torch.optim.Optimizer | None, together: bool) -> None:
        """Apply the policy to the job's first event (already noted). ``together``: every rank of
        the group is here at the same step (so the capture may use collectives); a local decision
        of one rank of many writes no incident."""
        policy, group = self.settings.on_nan, self.group
        world = group.world_size if together and group.active else 1
        message = f"{event}; {_action(policy, world, optimizer is not None)}"
        if event.rank == group.rank:
            log.error("nanguard: %s", message)
        wanted = policy == "raise" and self.settings.capture is not False or (
            policy == "skip" and self.settings.capture)
        if wanted and (together or not group.active):
            self._capture(event, optimizer)
        if policy == "skip" and optimizer is not None:
            for param in params(optimizer):
                param.grad = None  # the optimizer leaves parameters without gradients untouched
            self.skipped_steps += 1
        if policy == "raise":
            error = NonFiniteError(message, event, self.incident)
            self.reporter.stopped(event.step, "nonfinite")
            if self.on_stop is not None:
                self.on_stop(error)
            raise error

    def stop(self, step: int) -> None:
        """A stop was requested (here, or on another rank): raise it, before the update."""
        taken = self.reporter.take_stop()
        reason, origin = taken or ("requested by the coordinator through another rank", "policy")
        error = StopRequested(f"stop requested ({reason}) at step {step}; stopping all ranks before the"
                              " optimizer step", step=step, reason=reason)
        self.reporter.stopped(step, origin)
        if self.on_stop is not None:
            self.on_stop(error)
        raise error

    def watch_norms(self, norms: list[float], owners: list[torch.Tensor], make: Callable[..., Event]) -> None:
        """Grad-norm guard: warn on a threshold and on a spike over the running level."""
        norm = math.hypot(*norms)
        self.last_grad_norm = norm
        if self.settings.param_grad_norms:
            self.last_param_grad_norms = {self.param_name(p): n for p, n in zip(owners, norms)}
        warnings = self.norms.observe(norm)
        if not warnings:
            return
        ranked = sorted(zip(norms, owners), key=lambda pair: -pair[0])[:5]
        top = {self.param_name(p): n for n, p in ranked}
        for warning in warnings:
            event = make({"kind": warning.kind, "layer": next(iter(top), ""), "grad_norm": norm,
                          "message": warning.message, "extra": {"top_params": top}})
            self.events.add(event)
            self.reporter.note(event, "warn")
            log.warning("nanguard: %s", event)

    # ------------------------------------------------------------------ incidents
    def _capture(self, event: Event, optimizer: torch.optim.Optimizer | None) -> None:
        model, batches, rng = self.capture_inputs()
        collectives = self.group

        def rank_part() -> dict[str, Any]:  # called where a failure cannot skip a collective
            return {"model_state": unwrap(model).state_dict() if model is not None else {},
                    "optimizer_state": optimizer.state_dict() if optimizer is not None else None,
                    "extra_states": {name: obj.state_dict() for name, obj in self.states.items()},
                    "batches": capture.to_cpu(batches) if self.settings.capture_batch else None,
                    "rng": rng, "events": self.events.snapshot()}

        self.incident = capture_step(collectives, self.settings, self.identity, event, rank_part,
                                     sharded=sharding(model))
        if self.incident is not None and event.rank == collectives.rank:
            log.error("nanguard: state from before step %d saved to %s (nanguard inspect %s)",
                      event.step, self.incident, self.incident)
        if self.incident is not None and collectives.rank == 0:
            self.reporter.captured(event.step, self.incident)


def capture_inputs(roots: list, detector: Detector, rng_at_start: dict[str, Any] | None
                   ) -> tuple[nn.Module | None, list, dict]:
    """The model to save (the first root with parameters), the step's batches of that model's
    root, and the RNG as it was when the step began (numpy's read now: training does not draw it)."""
    model = next((m for m in (r() for r in roots) if m is not None and next(m.parameters(), None) is not None),
                 None)
    root = detector.slot_of(model) if model is not None and detector.owns(model) else None
    batches = [{"args": a, "kwargs": k} for slot, a, k in detector.log.batches if root is None or slot == root]
    now = capture.rng_snapshot()
    return model, batches, now if rng_at_start is None else {**rng_at_start, "numpy": now["numpy"]}


def settings_record(settings: Settings) -> dict[str, Any]:
    """The guard's settings as an incident keeps them (never the token)."""
    record = {}
    for name in settings.__dataclass_fields__:
        if name == "token":
            continue  # a secret never goes to disk
        value = getattr(settings, name)
        record[name] = [v if isinstance(v, str) else v.__name__ for v in value] if isinstance(
            value, tuple) else value
    return record


def capture_step(collectives: Collectives, settings: Settings, identity: RankInfo, event: Event,
                 rank_part: Callable[[], dict[str, Any]], *, sharded: str | None) -> str | None:
    """Every rank writes its part of one incident folder; rank 0 writes the manifest last.

    A failed write is reported and leaves no complete-looking folder; it never stops the
    error from being raised.
    """
    rank, world = collectives.rank, collectives.world_size
    path = None
    if rank == 0:
        try:
            path = capture.new_incident_dir(settings.dir, capture.incident_id(identity.run_id, event.step))
        except (OSError, IncidentError) as exc:
            log.error("nanguard: no incident written: cannot create a folder under %s (%s)", settings.dir, exc)
    path = collectives.broadcast_object(path)
    if path is None:
        return None
    record = None
    try:
        record = capture.write_rank(path, rank, **rank_part(), environment=capture.environment_record(
            rank=rank, world_size=world, settings=settings_record(settings)))
    except Exception:  # noqa: BLE001
        # Whatever failed here (a state_dict, a copy, the disk), this rank must still reach
        # the collectives below, or every other rank would hang in them.
        log.exception("nanguard: rank %d could not write its part of the incident", rank)
    records = collectives.all_gather_object(record)
    complete = all(r is not None for r in records)
    if rank == 0 and complete:
        try:
            capture.finalize(path, world_size=world, step=event.step, first_event=event,
                             rank_records=records, capture_batch=settings.capture_batch, sharded=sharded)
        except IncidentError as exc:
            log.error("nanguard: the incident could not be completed: %s", exc)
            complete = False
    return path if collectives.broadcast_object(complete) else None
