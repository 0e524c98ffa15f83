"""The step clock: which optimizer step a guard is in, counted by the first optimizer seen (or by
``end_step`` where there is none), and the part of a step each further optimizer's decision makes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class StepClock:
    """Which optimizer step the process is in, as events and reports count it.

    With several optimizers one of them counts the steps (the *primary*: the first to step), and
    the others' steps belong to its last one: a GAN's generator steps after its discriminator, with
    a forward of its own in between, in the same iteration. An optimizer that steps twice without
    the primary stepping in between becomes the primary (the one that steps most often, or the
    only one left stepping)."""

    step: int = 0
    """optimizer steps seen (with several optimizers, the primary's)"""
    index: int = 0
    """the 0-based step that events happen in"""
    optimizer_seen: bool = False
    """an optimizer step was ever decided (else a forward's end decides: eval, inference)"""
    stepped: bool = False
    """a step was counted since the GradScaler's last update() (else the scaler skipped it)"""
    primary: weakref.ref | None = None
    """the optimizer that counts the steps"""
    others: list = field(default_factory=list)
    """ids of the other optimizers that stepped since the primary's last step"""
    part: int = 0
    """how many optimizer steps of this step came before the one being decided (0: the primary's)"""

    def begin(self, optimizer: torch.optim.Optimizer, count: bool) -> bool:
        """An optimizer step is being decided; True when it counts as a new step."""
        self.optimizer_seen = True
        primary = self.primary() if self.primary is not None else None
        if primary is not optimizer and (primary is None or id(optimizer) in self.others):
            self.primary, primary = weakref.ref(optimizer), optimizer
        if primary is optimizer:
            self.others.clear()
        elif count:
            self.others.append(id(optimizer))
        self.part = 0 if primary is optimizer else max(len(self.others), 1)
        counted = primary is optimizer and count
        self.index = self.step if counted else max(self.step - 1, 0)
        self.stepped = self.stepped or counted
        return counted

    def skipped(self) -> bool:
        """A step whose update the GradScaler skipped (an Inf in its scaled gradients: no optimizer
        stepped) is a step all the same, as the training loop and its trainer count it."""
        self.optimizer_seen = True
        self.others.clear()
        self.part = 0
        self.index = self.step
        return True

    def end(self, counted: bool) -> None:
        self.step += counted
        self.index = self.step

    def follow(self, optimizer: torch.optim.Optimizer) -> bool:
        """Another model's optimizer stepped, in a guard with none of its own: the steps are counted
        as its steps count them, while a forward's end still decides. True when it counted. Where
        others stepped after the primary in the last step (a GAN's generator after its critic), the
        forwards between the primary's step and theirs belong to the step the primary's began."""
        seen, stepped, others = self.optimizer_seen, self.stepped, len(self.others)
        counted = self.begin(optimizer, True)
        self.end(counted)
        self.optimizer_seen, self.stepped = seen, stepped
        if counted and others:
            self.index = self.step - 1
        return counted
