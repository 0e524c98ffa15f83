"""The per-step decision: one device vector, one all-reduce, one host read, one agreement.

At the optimizer step every probe of the step (already side by side in their places) and the
gradients' norms are joined into one small device vector. Under ``torch.distributed`` a two-number flag (something is bad, a stop was
requested) is all-reduced first, so every rank takes the same decision; then the vector is read
to the host: the only device-to-host read of a clean step. Only when something is bad do the
ranks look closer (``diagnose``) and agree on the job's first event.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from .._dist import Collectives, RankInfo
from ..config import Settings
from ..events import Event
from ..protocol import FIRST_EVENT_ORDER
from . import diagnose, forensics, microscope, peer
from .backward import as_left, gradient_norms
from .detector import Detector, optimizer_steps
from .modules import params
from .reading import Finding, Reading
from .places import Slots, concat, stack
from .records import CHECK, OUT, StepLog
from .clock import StepClock
from .verdict import escalate, with_verdict

log = logging.getLogger("nanguard")

if TYPE_CHECKING:
    from .observer import StepObserver
    from .respond import Responder


_UNWATCHED_RANKS = ("no rank's own gradients were seen before a sum across ranks (no DDP bucket or FSDP2"
                    " reduce-scatter was watched: a communication hook registered before nanguard's own (before"
                    " init, or on a DDP made after init, before its first forward), a collective"
                    " inside the model such as tensor parallelism's all_reduce, gradients all-reduced by hand),"
                    " and a sum can give every rank the same values before they are read: the rank named is the"
                    " lowest that held them as its backward pass left them, the one where they were born is not"
                    " known")
_EVALUATED = "in a forward with autograd off {} (an evaluation, not a training step: training goes on)"
_ASIDE = ("a forward with autograd off before this step's training forward made a non-finite value too (in {},"
          " reported as an evaluation): if the loss took a value from it (a teacher's targets"
          " computed under no_grad), the NaN came from there")
_UNPROPAGATED = ("in a forward whose output was never backpropagated before the optimizer step (the script"
                 " dropped it: its own check of the loss, say), so no update came from it: training goes on")
_UNUSED = ("in a value that reached none of what the update depends on: the gradients the optimizer applies, the"
           " tensors given to check and the buffers the step wrote are all finite (an intended -inf, a masked"
           " score), so the step was not stopped: training goes on")
_DROPPED = ("in a step the script dropped after its backward pass (its gradients were zeroed without an"
            " optimizer step: its own check of the loss or the gradients, or a GradScaler's skip, say), so no"
            " update applied it: training goes on (a GradScaler given to nanguard.init(scaler=...) has such"
            " steps counted and decided)")


def read_step(probes: list[torch.Tensor], norms: list[torch.Tensor], buckets: list[torch.Tensor],
              collectives: Collectives | None, *, early: bool, stop: bool, watches_buckets: bool,
              evidence: list[torch.Tensor] = (), buffers: list[torch.Tensor] = (),
              extras: list[torch.Tensor] = (), slots: tuple[Slots, Slots] | None = None,
              applied: list[torch.Tensor] = ()) -> Reading | None:
    """Gather into one vector, all-reduce the flag (``collectives`` given: every rank is here), read once.

    ``early``: this rank already knows the step is bad; ``stop``: this rank was asked to stop.
    ``evidence`` is read with the rest but cannot make the step bad. ``slots``: where ``probes``
    and ``evidence`` were written, when a detector's (read as slices, not stacked). None when there
    is nothing to read and no one to agree with.
    """
    probe_slots, evidence_slots = slots if slots is not None else (Slots(), Slots())
    others = list(norms) + list(applied) + list(buckets) + list(buffers)
    faults = len(probes) + len(others)
    pieces = [piece for piece in (probe_slots.vector(probes, others), evidence_slots.vector(list(evidence)),
                                  stack(list(extras)) if extras else None)
              if piece is not None]
    if not pieces and collectives is None:
        return None
    vector = concat(pieces) if pieces else torch.zeros(0, device=collectives.device())
    if collectives is not None:
        # x * 0 is 0 for every finite x and NaN otherwise: a sum of huge finite values cannot overflow
        fault = vector[:faults].mul(0).sum()
        flags = torch.stack([fault + (math.nan if early else 0.0),
                             torch.full((), float(stop), device=vector.device)])
        collectives.all_reduce(flags)
        vector = torch.cat([flags, vector])
    values = vector.tolist()  # the one device-to-host read of the step
    if collectives is not None:
        (flag, stop_sum), values = values[:2], values[2:]
        bad, stop = not math.isfinite(flag), bool(stop_sum)
    else:
        bad = early or not all(map(math.isfinite, values[:faults]))
    split, end, tail = len(probes) + len(norms), faults - len(buffers), len(values) - len(extras)
    mid = split + len(applied)
    return Reading(bad, stop, probe_slots.in_order(values[:len(probes)]), values[len(probes):split],
                   evidence_slots.in_order(values[faults:tail]),
                   not all(map(math.isfinite, values[mid:end])) if watches_buckets else None,
                   values[end:faults], values[tail:], values[mid:end], values[split:mid])


def agree(collectives: Collectives | None, local: Finding | None) -> Finding | None:
    """The job's first finding, the same on every rank: a forward producer beats the gradients
    it poisoned, a value born on a rank beats what the all-reduce spread, then the earliest in the
    step (the first backward pass whose sum across ranks carried it; a value that a collective
    inside the model spread is seen later than where it was born), then the rank whose own shard
    of the module's state explains it (FSDP2), then the lowest rank."""
    if collectives is None:
        return local
    mine = None if local is None else (local.event.to_dict(), local.born_here, local.position, local.own_state,
                                       local.summed_pass)
    candidates = [Finding(Event.from_dict(event), born_here, position, own, summed_pass)
                  for event, born_here, position, own, summed_pass in filter(None, collectives.all_gather_object(mine))]
    if not candidates:
        return None
    return min(candidates, key=lambda f: (FIRST_EVENT_ORDER.get(f.event.kind, 9), not f.born_here, f.summed_pass,
                                          f.position or (math.inf, math.inf), not f.own_state, f.event.rank))


def _relayed(first: Finding, local: Finding) -> str | None:
    """Why this rank's ``local`` finding, which it took for born here, is what another rank's
    ``first`` (the job's) sent it, or None: gradients an earlier backward pass's sum across ranks
    brought in (accumulation without ``no_sync``: every rank's next buckets hold them), or a
    module whose FSDP2-gathered weights hold the other rank's bad shard."""
    if not (first.born_here and local.born_here):
        return None
    rank = first.event.rank
    if local.event.kind in ("grad", "loss") and first.summed_pass < local.summed_pass:
        return (f"rank {rank}'s own gradients were non-finite in an earlier backward pass of this step"
                f" (pass {first.summed_pass + 1}), whose sum across ranks brought them here: this rank's"
                f" gradients of pass {local.summed_pass + 1} were summed on top of them")
    if first.own_state and not local.own_state and local.event.kind == "forward" and (
            local.event.layer, local.position) == (first.event.layer, first.position):
        return (f"the module's weights were gathered from every rank's shard, and rank {rank}'s holds the"
                " non-finite values")
    return None


def harmless(log: StepLog, reading: Reading) -> str | None:
    """Why the non-finite values the step read leave its update safe, or None when they do not
    ("What stops a step", DESIGN.md): every gradient the optimizer would apply, every buffer the step
    wrote and every tensor given to ``check`` is finite, so what is bad is a module output that reached
    none of them (a policy's intended -inf logits, a masked score) or a forward the script never
    backpropagated. Another rank's bad value (``reading.bad`` is the job's) leaves this rank nothing to
    say: harmless here."""
    if reading.local_grads_bad or not all(map(math.isfinite, [*reading.norms, *reading.applied, *reading.buffers])):
        return None
    probes, unpropagated = reading.probes, True
    for index, record in enumerate(log.records):
        if record.pos < 0 or record.role not in (OUT, CHECK) or (
                math.isfinite(probes[record.pos]) and math.isfinite(probes[record.pos + 1])):
            continue
        if record.role == CHECK or record.check is not None:
            return None  # a tensor the script asked to check: decisive
        unpropagated = unpropagated and not record.compiled and (
            bisect.bisect_right(log.spans, (index, math.inf, math.inf)) - 1 in log.unpropagated)
    return _UNPROPAGATED if unpropagated else _UNUSED


def changed_gradients(owners: list[torch.Tensor], log: StepLog,
                      summed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, norms of their gradients as they are now) where the gradients the backward pass
    left (``StepLog.produced``) may have changed since, else nothing: the optimizer applies what
    they are now. DDP's sum across ranks (an overflow, fp16 compression), clipping, unscaling or the
    script's own division can make a finite gradient non-finite after the backward pass. With
    several ranks (``summed``) they are read again whatever their versions say: a collective
    writes into a tensor without counting a version."""
    if log.produced is None or (not summed and as_left(owners, log.left)):
        return [], []
    return gradient_norms(owners)


class Decider:
    """Runs each step's decision for a guard: read, diagnose and agree when bad, then respond
    (``respond.py``) and tell the step observer (a replay) and the coordinator."""

    def __init__(self, settings: Settings, detector: Detector, collectives: Collectives, clock: StepClock,
                 identity: RankInfo, respond: Responder, observer: StepObserver):
        self.settings = settings
        self.detector = detector
        self.collectives = collectives
        self.clock = clock
        self.identity = identity
        self.respond = respond
        self.observer = observer
        self._early: diagnose.Finding | None = None
        self._aside: Event | None = None
        """a bad value of a forward with autograd off settled apart as the step's first training forward
        began (a teacher's targets, computed under no_grad): a loss made of it is told so"""
        """a bad step found by settle_early(), waiting for the next decision"""
        self._seen: microscope.Look | None = None
        """what the microscope saw of the step being decided"""
        self._bad_at: int | None = None
        """the index of the last step found bad (its other optimizers' steps are that step's)"""

    def settle_early(self, apart: str | None = None) -> None:
        """Too many probes without a step (a long eval loop): read them now, locally. ``apart``:
        they are of no training step, and a bad value among them is reported without stopping
        training (``on_nan`` is for the training steps): ``"evaluation"``, forwards with autograd
        off between optimizer steps (a validation pass); ``"dropped"``, a step the script dropped
        after its backward pass (its gradients zeroed without an optimizer step)."""
        log = self.detector.log
        if log.values and self._early is None:
            reading = read_step(log.values, [], [], None, early=False, stop=False, watches_buckets=False,
                                evidence=log.evidence, slots=(log.value_slots, log.evidence_slots))
            if reading.bad and apart is None:
                self._early = self._diagnose(reading)
            elif reading.bad:
                step = self.clock.step
                when = f"after optimizer step {step - 1}" if step else "before any optimizer step"
                finding = self._settle_apart(reading, _EVALUATED.format(when) if apart == "evaluation" else _DROPPED)
                if apart == "evaluation" and finding is not None:
                    self._aside = finding.event
        self.detector.reset()
        if self._early is not None and not self.clock.optimizer_seen:
            self._respond_to(self._take_early(), None, together=False)

    def _settle_harmless(self, reading: Reading, optimizer: torch.optim.Optimizer | None,
                         collectives: Collectives | None) -> None:
        """At an optimizer step, a bad step whose update depends on no bad value (``harmless``) is
        clean: what is bad is reported apart, as a warning. With several ranks, only when every rank
        finds so (one more collective, on a bad step only: the ranks' decisions must agree). Decided
        at a forward's end, without an optimizer, the outputs are what is decided on."""
        if not reading.bad or optimizer is None:
            return
        why = harmless(self.detector.log, reading) if self._early is None else None
        if collectives is not None:
            votes = torch.tensor([float(why is not None)], device=collectives.device())
            collectives.all_reduce(votes)
            why = why if int(votes.item()) == collectives.world_size else None
        if why is not None:
            self._settle_apart(reading, why)
            reading.bad = False

    def _settle_apart(self, reading: Reading, why: str) -> Finding | None:
        """Report the first bad value of forwards of no training step, or of none the update depends
        on (``why`` says which), without acting on it; returns it."""
        finding = self._diagnose(reading)
        if finding is not None:
            if why is not _UNUSED:
                finding.event.micro_batch = None  # (not a micro-batch of a training step)
            finding.event.message = "; ".join(filter(None, (why, finding.event.message)))
            self.respond.observed(finding)
        return finding

    def _take_early(self) -> diagnose.Finding:
        finding, self._early = self._early, None
        return finding

    def decide(self, optimizer: torch.optim.Optimizer | None, collective: bool,
                gradients_too: bool = True) -> None:
        collectives = self.collectives if collective and self.collectives.active else None
        detector = self.detector
        optimizer_steps(detector, optimizer)
        owners, norms = self._gradients(optimizer) if gradients_too else ([], [])
        several = collectives is not None and collectives.world_size > 1
        later, applied = changed_gradients(owners, detector.log, several) if gradients_too else ([], [])
        written = detector.buffers.written()
        reading = read_step(detector.log.values, norms,
                            detector.log.buckets if gradients_too else [], collectives,
                            early=self._early is not None, stop=self.respond.reporter.stop_requested,
                            watches_buckets=detector.backward.watched(), evidence=detector.log.evidence,
                            buffers=detector.buffers.probes(written), extras=self.respond.extras(),
                            slots=(detector.log.value_slots, detector.log.evidence_slots), applied=applied)
        if reading is None:  # nothing checked, nobody to agree with
            detector.reset()
            self.respond.step_ended(self.clock.index, loss=None, extras=[], norms=[], owners=[],
                                    optimizer=optimizer, clean=self._early is None)
            if self._early is not None:
                self._respond_to(self._take_early(), optimizer, together=False)
            self._clean(stop=self.respond.reporter.stop_requested)
            return
        reading.several = several
        self._settle_harmless(reading, optimizer, collectives)
        loss = reading.probes[detector.log.loss_at] if detector.log.loss_at is not None else None
        # the gradients' series: as the backward pass left them, or where a GradScaler scaled those, as applied
        series, held = (reading.applied, later) if detector.backward.scaled and later else (reading.norms, owners)
        if reading.bad and self.clock.part and self._bad_at == self.clock.index:
            # another optimizer of a step already found bad (the same on every rank): the policy
            # again, not a second report of what that step's first decision reported
            detector.reset()
            self.respond.again(optimizer)
            self._report_step(reading.stop)
            return
        if reading.bad:
            first = self._agreed(reading, owners, written, collectives, later)
            if first is not None:
                # in the flight recorder before a capture writes it
                self.respond.step_ended(self.clock.index, loss=loss, extras=reading.extras, norms=series,
                                        owners=held, optimizer=optimizer, clean=False)
                self._bad_at = self.clock.index
                try:
                    self._respond_to(first, optimizer, together=collectives is not None)
                finally:
                    detector.reset()  # the step's batches were held for the capture until here
                # on_nan warn or skip: training goes on, so the step counts as one like any other
                self._report_step(reading.stop)
                return
        detector.reset()
        if series and not self.clock.part:  # one series: the steps of the optimizer counting them
            self.respond.watch_norms(series, held, self.event)
        self.respond.step_ended(self.clock.index, loss=loss, extras=reading.extras, norms=series,
                                owners=held, optimizer=optimizer, clean=True)
        self._clean(reading.stop)

    def _agreed(self, reading: Reading, owners: list[torch.Tensor], written: list,
                collectives: Collectives | None, later: list[torch.Tensor]) -> Finding | None:
        """The job's first finding of a bad step: this rank's diagnosis, agreed on by every rank;
        this rank's own, when another rank's is the job's, is noted beside it. ``later``: the
        parameters of ``reading.applied``."""
        grads = [None if p.grad is None else forensics.plain(p.grad) for p in owners]
        verdict, self._seen = self.detector.verdict, None
        if self._early is not None:
            local = self._take_early()
        elif verdict:
            local = self._look(reading, owners, grads, written, later)
        else:
            local = self._diagnose(reading, owners, grads, written, later)
        seen, self._seen = self._seen, None  # (its re-run's outputs hold graphs whose hooks hold the guard)
        if verdict and seen is not None and reading.several and self.detector.backward.ddp:  # (alike on every rank)
            peer.compare(self.collectives, self.detector, seen, local.event if local is not None else None,
                         int(self.settings.detail_mb * 2**20), owners)
        aside, self._aside = self._aside, None
        if local is not None and aside is not None and local.event.kind in ("grad", "loss"):
            local.event.message = "; ".join(filter(None, (local.event.message, _ASIDE.format(
                aside.layer or f"the model ({aside.module_type})"))))
        first = agree(collectives, local)
        several = collectives is not None and collectives.world_size > 1
        if first is not None and several and first.event.kind in ("grad", "loss") and (
                not self.detector.backward.watched()):  # (the same on every rank)
            first.event.message = "; ".join(filter(None, (first.event.message, _UNWATCHED_RANKS)))
        if first is not None and local is not None and first.event.rank != local.event.rank:
            if (why := _relayed(first, local)) is not None:  # not born here after all: not this rank's to send
                local = replace(local, born_here=False)
                local.event.message = "; ".join(filter(None, (local.event.message, why)))
            elif first.position is not None and local.position is not None and first.position < local.position:
                local.event.message = "; ".join(filter(None, (local.event.message, (
                    f"rank {first.event.rank} saw a non-finite value earlier in this step, in"
                    f" {first.event.layer or 'its model'}: it may have come here through a collective"
                    " inside the model (a synchronised norm)"))))
            self.respond.note(local, self.settings.on_nan)
        if first is not None and first.event.reproduced is False:
            escalate(self.settings, self.detector)  # (the same on every rank: the job's first event)
        return first

    def _look(self, reading: Reading, owners: list[torch.Tensor], grads: list[torch.Tensor | None],
              written: list, later: list[torch.Tensor]) -> Finding | None:
        """Tier 2 on a bad step: the microscope re-runs the step's micro-batches under the full probes,
        and the finding says whether the re-run reproduced it. A sentinel's diagnosis reads what the
        re-run made; the full mode's reads what the original pass's probes saw (where they saw a value
        born, a clean re-run blames no less)."""
        detector = self.detector
        original = None if detector.sentinel else self._diagnose(reading, owners, grads, written, later)
        try:
            with microscope.rerun(detector, owners, reading.probes) as look:
                self._seen = look
                made = detector.log
                fresh = read_step(made.values, [], [], None, early=False, stop=False, watches_buckets=False,
                                  evidence=made.evidence, slots=(made.value_slots, made.evidence_slots))
                reading = replace(reading, probes=fresh.probes if fresh is not None else [],
                                  evidence=fresh.evidence if fresh is not None else [])
                if look.diverged or (look.unsure and all(map(math.isfinite, look.forward_probes(reading.probes)))):
                    # its probes are not the original pass's, or not all of it and finite: they say nothing
                    # of where the value was born, nor that the forward was finite
                    detector.log.forget_probes()
                    reading = replace(reading, probes=[], evidence=[])
                finding = original if not detector.sentinel else self._diagnose(reading, owners, grads, written, later)
        except Exception:  # noqa: BLE001 - a bad step is acted on whatever the re-run does
            log.exception("nanguard: the microscope's re-run of a bad step failed; the step is judged without it")
            detector.log.forget_probes()  # (what a failed re-run probed matches no reading)
            return original if not detector.sentinel else self._diagnose(
                replace(reading, probes=[], evidence=[]), owners, grads, written, later)
        if finding is None:
            return None
        forward_bad = not all(map(math.isfinite, look.forward_probes(reading.probes)))
        # a gradient the backward pass left non-finite, on this rank itself (not one the script made so
        # after it, nor one a sum across ranks brought in): what a clean backward re-run disproves
        own = detector.log.produced is not None and not all(map(math.isfinite, reading.norms)) and (
            reading.local_grads_bad if reading.several else True)
        return with_verdict(finding, look.reproduced(forward_bad, own), look, self.identity.host,
                             seen_born=original is not None and original.position is not None)

    def _diagnose(self, reading: Reading, *gradients_and_buffers) -> Finding | None:
        """``diagnose.first_bad``; should it fail, a finding that says so: the step is still bad,
        and every rank must still take the decision (an error here would leave the others waiting)."""
        try:
            return diagnose.first_bad(self.detector.catalog, self.detector.log, reading, self.event,
                                      *gradients_and_buffers)
        except Exception as exc:  # noqa: BLE001 - a bad step must be acted on whatever the diagnosis does
            log.exception("nanguard: the diagnosis of a bad step failed")
            kind = "forward" if not all(map(math.isfinite, reading.probes)) else (
                "buffer" if not all(map(math.isfinite, reading.buffers)) else "grad")
            return Finding(self.event({"kind": kind, "layer": "unknown", "message": (
                f"a non-finite value was found, but where it was born could not be worked out: the diagnosis"
                f" failed ({type(exc).__name__}: {exc}), a fault of nanguard's (please report it)")}))

    def _gradients(self, optimizer: torch.optim.Optimizer | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameters, norms of their gradients as the backward pass left them, or as they are now
        where it was not watched)."""
        if optimizer is None:
            return [], []
        produced = self.detector.log.produced
        if produced is None:  # no backward pass left a gradient (``BackwardWatch._ended``): as they are now
            return gradient_norms(params(optimizer))
        if self.detector.backward.scaled:  # the scaler checks and unscales only what this optimizer steps
            mine = {id(p) for p in params(optimizer)}
            kept = [(p, n) for p, n in zip(*produced) if id(p) in mine]
            return [p for p, _ in kept], [n for _, n in kept]
        return produced

    def _respond_to(self, finding: diagnose.Finding, optimizer: torch.optim.Optimizer | None,
                    together: bool) -> None:
        self.respond.note(finding, self.settings.on_nan)
        self.observer.decided(finding.event)  # a replay ends here
        self.respond.act(finding.event, optimizer, together)

    def _clean(self, stop: bool) -> None:
        """After a step found clean: a replay ends here, then the step is reported."""
        self.observer.decided(None)
        self._report_step(stop)

    def _report_step(self, stop: bool) -> None:
        """The coordinator hears of the step, and a stop requested here or on any rank is raised
        (every rank takes this decision at the same step: ``stop`` was all-reduced)."""
        self._aside = None  # (of this step only)
        self.respond.reporter.heartbeat(self.clock.index, self.respond.last_step_time, self.respond.last_grad_norm)
        if stop:
            self.respond.stop(self.clock.index)

    def event(self, fields: dict[str, Any]) -> Event:
        return Event(rank=self.collectives.rank, step=self.clock.index, host=self.identity.host,
                     time=time.time(), **fields)


