"""The verdict inside the job: what the microscope's re-run of a bad step says (reproduced or not, on
which device), written into the step's event; and, after a transient under a policy that trains on,
the sentinel's escalation to the full probes."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch

from ..config import Settings
from ..events import Event
from . import forensics, microscope
from .diagnose import finite_forward
from .detector import Detector
from .reading import Finding

log = logging.getLogger("nanguard")

_RERAN = ("not reproduced: the microscope re-ran the step from memory on this device ({device}, host {host}), with the"
          " same weights, batch and random state, and every value it made was finite. What the re-run cannot give back"
          " comes first among the suspects: the script's own state (a step counter or rank its model's code keys on,"
          " Python or numpy draws, a global it changed; key such code on guard.step), then non-determinism, then a"
          " transient fault of the hardware")
_TRANSIENT = _RERAN + "; nothing in the model is blamed for it"
_TRANSIENT_SEEN = _RERAN + "; this step's probes saw it born here"
_UNSEEN = "whether it is reproducible is not known: {}"
_FROM_THE_LOSS = ("{}, and the gradient that reached the model's output{}"
                  " was already non-finite there (kept for the microscope): it was made by the loss or by code"
                  " between the model and the loss, not by the model's backward pass, whose first parameter"
                  " gradient it made non-finite is {} (guard.check(loss) shows the loss's value)")
_BACKWARD_FIRST = ("the microscope re-ran each micro-batch's backward pass apart: micro-batch {} was the first whose own"
                   " gradients it made non-finite")


def with_verdict(finding: Finding, reproduced: bool | None, look: microscope.Look, host: str,
                  seen_born: bool = False) -> Finding:
    """``finding`` with what the microscope's re-run said: ``Event.reproduced``, ``verdict`` and ``device``;
    one not reproduced names the fault of this device, and no module unless a probe of the original pass
    saw it born there (``seen_born``: the full mode's)."""
    event = finding.event
    event.reproduced = reproduced
    event.verdict = {True: "reproducible", False: "transient"}.get(reproduced)
    event.device = microscope.device_name()
    if reproduced is False and seen_born:
        event.message = "; ".join(filter(None, (event.message, _TRANSIENT_SEEN.format(device=event.device, host=host))))
        return finding
    if reproduced is False:
        event.message = _TRANSIENT.format(device=event.device, host=host)
        event.input_nonfinite = event.output_nonfinite = None
        if look.original_outputs_bad:  # the forward made it: the model's output, no module of it
            event.kind, event.layer, event.module_type = "forward", "", look.root_type
            if look.bad_output is not None:
                _as_output(event, *look.bad_output)
        return replace(finding, position=None)
    if event.kind == "loss" and look.gradient_in_bad and event.extra.get("bad_params") and not look.original_outputs_bad:
        # what the diagnosis could only suspect, the gradient kept at the model's output shows
        known = [k for k in look.gradient_in_bad if k is not None]
        event.micro_batch = known[0] if known else event.micro_batch
        where = f" in micro-batch(es) {', '.join(map(str, known))}" if known else ""
        event.message = _FROM_THE_LOSS.format(finite_forward(look.unchecked_parts), where, event.extra["bad_params"][0])
    if reproduced is None and look.missed:
        event.message = "; ".join(filter(None, (event.message, _UNSEEN.format("; ".join(look.missed)))))
    if reproduced and event.kind == "grad" and event.micro_batch is None and look.backward_first is not None:
        # each micro-batch's backward re-run apart: the first to make it is where it was born
        event.micro_batch = look.backward_first
        event.message = "; ".join(filter(None, (event.message, _BACKWARD_FIRST.format(look.backward_first))))
    return finding


_TENSOR_FIELDS = ("output_field", "shape", "dtype", "numel", "bad_count", "nan_count", "inf_count", "finite_min",
                  "finite_max", "finite_mean", "first_index", "first_value")


def _as_output(event: Event, micro_batch: int | None, tensor: torch.Tensor, whole: bool) -> None:
    """``event`` made a report of the model's non-finite output ``tensor`` of ``micro_batch`` (``whole``:
    the output itself, described exactly; else its two extremes, which tell NaN and Inf apart, no more),
    where it told of the value the decision first found bad (a gradient, the loss)."""
    for name in _TENSOR_FIELDS:
        setattr(event, name, None)
    event.micro_batch = micro_batch
    if whole:
        fields = forensics.describe(tensor)
    else:
        low, high = tensor.tolist()
        fields = {"dtype": str(tensor.dtype).removeprefix("torch."), "has_nan": math.isnan(low) or math.isnan(high),
                  "has_inf": math.isinf(low) or math.isinf(high)}
    for name, value in fields.items():
        setattr(event, name, value)


def escalate(settings: Settings, detector: Detector) -> None:
    """After a fault the microscope did not reproduce, under a policy that trains on (skip, warn):
    every module is probed on every step from now on, so the next transient is caught at its producer."""
    if settings.escalate and settings.on_nan != "raise" and detector.sentinel:
        detector.sentinel = False
        detector.probes.install()
        log.warning("nanguard: a fault was not reproduced when re-run (a transient): every module is checked"
                    " on every step from now on (mode full; escalate=False keeps the sentinel)")
