"""What a guard does once a step is decided: the ``on_nan`` policy for the job's first event
(report, capture an incident, skip the update or raise), a requested stop, and the warnings of
the gradient-norm monitor."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._dist import Collectives, RankInfo
from .._torch import scaler_scale
from .._throttle import Throttle
from ..config import Settings
from ..errors import NonFiniteError, StopRequested
from ..events import Event, RecentEvents, within
from ..incident import RankPart, capture_incident, rng_snapshot
from ..incident.rng import HOST
from ..protocol import OBSERVED
from . import forensics
from .buffers import Buffers
from .detector import Detector
from .fed import as_fed
from .flight import FlightRecorder
from .gradnorm import GradNormMonitor
from .modules import (MORE_MODELS, NON_PERSISTENT, OPTIMIZER_PARAMS, STEP_PART, local_optimizer,
                      non_persistent_buffers, params, sharding, unwrap)
from .reading import Finding
from .records import Catalog
from .reporter import Reporter
from .rewind import Rewind

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
    """Acts on decided steps for one guard. ``models_to_save()`` (the models, the first one's
    batches kept) and ``step_inputs(model)`` (the step's batches and the RNG at its start) give
    what an incident holds besides the optimizer."""

    def __init__(self, settings: Settings, identity: RankInfo, group: Collectives, reporter: Reporter,
                 events: RecentEvents, states: dict[str, Any], on_stop: Callable[[Exception], Any] | None,
                 models_to_save: Callable[[], list[tuple[str, nn.Module]]],
                 step_inputs: Callable[[nn.Module | None], tuple[list, dict[str, Any]]],
                 param_name: Callable[[torch.Tensor], str], buffers: Buffers):
        self.settings = settings
        self.identity = identity
        self.group = group
        self.reporter = reporter
        self.events = events
        self.states = states
        self.on_stop = on_stop
        self.models_to_save = models_to_save
        self.model_gone: Callable[[], bool] = lambda: False
        """whether a model given to the guard has been freed (set by the guard)"""
        self.step_part: Callable[[], int] = lambda: 0
        """how many optimizer steps of the step came before the one stopped (set by the guard)"""
        self.guarded_params: Callable[[], list[torch.Tensor]] = list
        """the trainable parameters of the guarded models (set by the guard)"""
        self.step_inputs = step_inputs
        self.buffers = buffers
        self.param_name = param_name
        self.incident: str | None = None
        self.rewind: Rewind | None = None
        """the parameters and optimizer state as the step began, while a later call of a closure is
        decided (set by the guard: ``rewind.closure_step``)"""
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_param_grad_norms: dict[str, float] = {}
        self.norms = GradNormMonitor(settings.grad_norm_warn, settings.spike_factor,
                                     settings.spike_warmup_steps)
        self.flight = FlightRecorder(settings.flight_steps) if settings.flight_steps else None
        self._last_step_at: float | None = None
        self.last_step_time: float | None = None
        self._log_throttle = Throttle(60.0)

    def note(self, finding: Finding, action: str) -> None:
        """Keep an event; send it to the coordinator when this rank is the one that saw it (values
        another rank sent through the all-reduce are that rank's event, not this one's)."""
        self.events.add(finding.event)
        if finding.event.rank == self.group.rank and finding.born_here:
            self.reporter.note(finding.event, action)

    def observed(self, finding: Finding) -> None:
        """A finding outside the training steps (an evaluation's forward): kept, logged (once a
        minute at most for the same place) and sent as observed (``OBSERVED``: the coordinator
        counts it apart and never stops a job for it), never acted on."""
        self.note(finding, OBSERVED)
        event = finding.event
        now, held = self._log_throttle.allow((event.kind, event.layer, "evaluation"))
        if now:
            log.warning("nanguard: %s%s", event, f" (and {held} more such in the last minute)" if held else "")

    def act(self, event: Event, optimizer: torch.optim.Optimizer | None, together: bool) -> None:
        """Apply the policy to the job's first event (already noted). ``together``: every rank of
        the group is here at the same step (so the capture may use collectives); a local decision
        of one rank of many writes no incident."""
        policy, group = self.settings.on_nan, self.group
        world = group.world_size if together and group.active else 1
        action = _action(policy, world, optimizer is not None)
        if event.rank == group.rank:
            # a storm (warn, skip: the same report every step) logs once a minute, with a count
            now, held = self._log_throttle.allow((event.kind, event.layer)) if policy != "raise" else (True, 0)
            if now:
                log.error("nanguard: %s; %s%s", event, action,
                          f" (and {held} more such step(s) in the last minute)" if held else "")
        if policy != "warn":
            self._restore_buffers()  # the step does not happen: what its forward wrote goes back
            if self.rewind is not None and optimizer is not None:  # (LBFGS: found in a later call of its closure)
                self.rewind.restore(optimizer)
                log.error("nanguard: %s had updated the weights in this step before the call of its closure that"
                          " went bad: they, and its state, were put back as they were before the step",
                          type(optimizer).__name__)
                if policy == "skip":
                    self.rewind.after_step(optimizer)
        wanted = policy == "raise" and self.settings.capture is not False or (
            policy == "skip" and self.settings.capture)
        if wanted and (together or not group.active):
            self._capture(event, optimizer)
        if policy == "skip" and optimizer is not None:
            self._drop(optimizer)
            self.skipped_steps += 1
        if policy == "raise":
            error = NonFiniteError(f"{event}; {action}", event, self.incident)
            self.reporter.stopped(event.step, "nonfinite")
            if self.on_stop is not None:
                self.on_stop(error)
            raise error

    def again(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Another optimizer steps in a step already found bad and acted on (a GAN's generator
        after its critic's step was skipped): with ``skip`` its update is dropped too, and what
        its forward wrote put back; no new report."""
        if self.settings.on_nan == "skip":
            self._restore_buffers()
            if optimizer is not None:
                self._drop(optimizer)

    def _drop(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's updates do not happen: its optimizer's, and those of every other optimizer of
        the guarded models (their gradients come from the same bad step)."""
        for param in (*params(optimizer), *self.guarded_params()):
            param.grad = None  # an optimizer leaves parameters without gradients untouched

    def stop(self, step: int) -> None:
        """A stop was requested (here, or on another rank): raise it, before the update."""
        taken = self.reporter.take_stop()
        reason, origin = taken or ("requested by the coordinator through another rank", "policy")
        self._restore_buffers()
        error = StopRequested(f"stop requested ({reason}) at step {step}; stopping all ranks before the"
                              " optimizer step", step=step, reason=reason)
        self.reporter.stopped(step, origin)
        if self.on_stop is not None:
            self.on_stop(error)
        raise error

    def _restore_buffers(self) -> None:
        missed = self.buffers.restore()
        if missed:
            log.warning("nanguard: buffer(s) %s were first written in this step, which is not taken: they"
                        " were not kept as it began (a buffer is kept from the step after the first that"
                        " writes it), so they keep what it wrote", ", ".join(missed[:8]))

    def extras(self) -> list[torch.Tensor]:
        """Device values read with the step for the flight recorder: the GradScaler's scale."""
        scale = scaler_scale(self.states.get("scaler")) if self.flight is not None else None
        return [scale.reshape(())] if scale is not None else []

    def step_ended(self, step: int, *, loss: float | None, extras: list[float], norms: list[float],
                   owners: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                   clean: bool) -> None:
        """Every decided step: its time and its row of the flight recorder."""
        now = time.monotonic()
        last, self._last_step_at = self._last_step_at, now
        step_time = self.last_step_time = now - last if last is not None else None
        grad_norm = self.last_grad_norm if clean and norms else None
        if self.flight is not None:
            lr = optimizer.param_groups[0].get("lr") if optimizer is not None and optimizer.param_groups else None
            self.flight.record(step, loss=loss, grad_norm=grad_norm, scale=extras[0] if extras else None,
                               lr=float(lr) if isinstance(lr, (int, float)) else None, step_time_s=step_time,
                               norms=norms, params=owners, name=self.param_name)

    def scaler_streak(self, skipped: int, scale: float, produced: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
                      make: Callable[..., Event]) -> None:
        """The GradScaler skipped ``skipped`` steps in a row and its ``scale`` fell below 1: gradients
        non-finite even scaled down are no overflow, and nothing is updated. A warning event (it
        stops nothing: the scaler's skips are its own), with the gradients the last backward pass
        left non-finite (``produced``: read here, once a run of skips)."""
        owners, norms = produced if produced is not None else ([], [])
        bad = [(self.param_name(p), float(n)) for p, n in zip(owners, norms) if not math.isfinite(float(n))]
        which = (f"{len(bad)} of {len(owners)} parameter gradients were non-finite as the last backward pass left"
                 f" them ({'NaN' if any(math.isnan(n) for _, n in bad) else 'infinite'}), among them"
                 f" {', '.join(name for name, _ in bad[:4])}" if bad else
                 "which gradients were non-finite is not known (the last backward pass left none that were)")
        event = make({"kind": "grad_norm", "layer": bad[0][0] if bad else "", "message": (
            f"the GradScaler skipped {skipped} optimizer steps in a row, and its scale is now {scale:g}: gradients"
            " non-finite even scaled down are not an overflow of the scale's making, and no update happens"
            f" until this is fixed; {which}")})
        self.events.add(event)
        self.reporter.note(event, "warn")
        log.warning("nanguard: %s", event)

    def watch_norms(self, norms: list[float], owners: list[torch.Tensor], make: Callable[..., Event]) -> None:
        """Grad-norm guard: warn on a threshold and on a spike over the running level."""
        if not all(map(math.isfinite, norms)):
            norms = [n if math.isfinite(n) else _exact_norm(p, n) for n, p in zip(norms, owners)]
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
        models = self.models_to_save()
        model = models[0][1] if models else None
        if model is None and self.model_gone():
            log.warning("nanguard: the model given to nanguard.init is gone (nanguard holds it weakly, and the"
                        " script kept no reference to it, a container made in the call, say): the incident"
                        " holds no weights; keep the model in a variable")

        part = self.step_part()

        def collect() -> RankPart:  # inside the capture: a failure here cannot skip a collective
            batches, rng = self.step_inputs(model)
            extra = {name: obj.state_dict() for name, obj in self.states.items()}
            unpersisted = non_persistent_buffers(unwrap(model)) if model is not None else {}
            if unpersisted:  # (read by the forward too: a replay without them runs another step)
                extra[NON_PERSISTENT] = unpersisted
            if part:  # the state is from after those steps: a replay from the step's start cannot run
                extra[STEP_PART] = part
            if optimizer is not None:  # which of the script's optimizers a replay loads it into
                extra[OPTIMIZER_PARAMS] = [self.param_name(p) for p in params(local_optimizer(optimizer))]
            if len(models) > 1:  # a bare init()'s other roots: a GAN's critic, an EMA teacher
                extra[MORE_MODELS] = {name: {"model": unwrap(other).state_dict(),
                                             NON_PERSISTENT: non_persistent_buffers(unwrap(other))}
                                      for name, other in models[1:]}
            return RankPart(model_state=unwrap(model).state_dict() if model is not None else {},
                            optimizer_state=local_optimizer(optimizer).state_dict() if optimizer is not None else None,
                            extra_states=extra,
                            batches=batches if self.settings.capture_batch else None, rng=rng,
                            events=self.events.snapshot(), settings=settings_record(self.settings),
                            flight=self.flight.to_dict() if self.flight is not None else None)

        self.incident = capture_incident(self.group, self.settings.dir, event, collect,
                                         job_id=self.identity.incidents_as, capture_batch=self.settings.capture_batch,
                                         sharded=sharding(model, optimizer))
        if self.incident is not None and event.rank == self.group.rank:
            log.error("nanguard: state from before step %d saved to %s (nanguard inspect %s)",
                      event.step, self.incident, self.incident)
        if self.incident is not None and self.group.rank == 0:
            self.reporter.captured(event.step, self.incident)


def _exact_norm(param: torch.Tensor, norm: float) -> float:
    """The norm of a finite gradient that overflowed its fused float computation (values past
    ~1e19), again in float64: rare, and exactly when a grad_norm warning must not vanish."""
    grad = param.grad
    if grad is None or not forensics.is_finite(grad):
        return norm
    return float(torch.linalg.vector_norm(forensics.stored(forensics.plain(grad)).double()))


def models_to_save(roots: list[tuple[Callable[[], nn.Module | None], str]], catalog: Catalog | None = None
                   ) -> list[tuple[str, nn.Module]]:
    """(prefix, root) of the roots with parameters still alive, in the order they were attached:
    the models an incident saves (the first one's batches and weights where one model is read).
    When every root is gone but one module of theirs lives on that holds the others still alive
    (the script took the model a wrapper held: PEFT's ``merge_and_unload()``), that one, as
    ``catalog`` names it; never one of several (a container's models: saving one would be a part)."""
    alive = [(name, m) for ref, name in roots if (m := ref()) is not None and next(m.parameters(), None) is not None]
    if alive or catalog is None:
        return alive
    live = sorted(((slot.name.count("."), slot.name, m) for slot in catalog.slots
                   if (m := slot.module()) is not None and next(m.parameters(), None) is not None),
                  key=lambda entry: entry[0])
    if not live or not all(within(name, live[0][1]) for _, name, _ in live):
        return []
    outermost = live[0][1:]
    log.warning("nanguard: the model given to nanguard.init is gone (the script went on with a model it held:"
                " a wrapper's merge_and_unload(), say): the incident holds the weights of %s, the outermost of"
                " its modules still alive", outermost[0] or "the model")
    return [("", outermost[1])]


def step_inputs(detector: Detector, model: nn.Module | None, rng_at_start: dict[str, Any] | None,
                saved: bool = True) -> tuple[list, dict[str, Any]]:
    """The step's batches fed to ``model``'s root (none unless ``saved``: the detector holds them for
    its microscope too), and the RNG as it was when the step began (python's and numpy's read now:
    the forward, backward and optimizer step do not draw from them)."""
    root = detector.slot_of(model) if model is not None and detector.owns(model) else None
    batches = [as_fed(a, k, versions) for slot, a, k, versions in detector.log.batches
               if saved and (root is None or slot == root)]
    now = rng_snapshot()
    return batches, now if rng_at_start is None else {**rng_at_start, **{g: now[g] for g in HOST}}


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
