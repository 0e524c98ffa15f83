"""The gradient-norm guard: warnings (never stops) on a threshold and on a spike over the
running level of the norm. Plain arithmetic on host floats the decision has already read."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NormWarning:
    kind: str
    """grad_norm | spike"""
    message: str


class GradNormMonitor:
    """Watches the total gradient norm of each clean step.

    ``threshold``: warn above it (None: never). ``spike_factor``: warn when the norm exceeds this
    many times its running level, once ``warmup_steps`` ordinary steps have set that level.
    """

    def __init__(self, threshold: float | None, spike_factor: float, warmup_steps: int):
        self.threshold = threshold
        self.spike_factor = spike_factor
        self.warmup_steps = warmup_steps
        self.level: float | None = None
        """the running level: the mean over warm-up, then an exponential average of ordinary steps"""
        self.ordinary_steps = 0

    def observe(self, norm: float) -> list[NormWarning]:
        """The warnings this step's total norm raises (none for a non-finite norm)."""
        if not math.isfinite(norm):
            return []  # finite gradients whose norm overflows: nothing to compare
        warnings = []
        if self.threshold is not None and norm > self.threshold:
            warnings.append(NormWarning("grad_norm", f"gradient norm {norm:.4g} is above grad_norm_warn"
                                                     f" {self.threshold:.4g}"))
        armed = self.ordinary_steps >= self.warmup_steps and self.level
        if armed and norm > self.spike_factor * self.level:
            warnings.append(NormWarning("spike", f"gradient norm {norm:.4g} is {norm / self.level:.1f}x"
                                                 f" its running level {self.level:.4g}"))
        else:
            self.ordinary_steps += 1
            weight = max(1 / self.ordinary_steps, 0.05)
            self.level = norm if self.level is None else (1 - weight) * self.level + weight * norm
        return warnings
