"""StepObserver: what a guard tells of its steps, at its few decision points.

The guard always has one; this one does nothing. The replay (``nanguard.replay.Replay``) is the
one that listens: it builds on the rank side, so the protocol lives here, where the guard is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..config import Settings
    from ..events import Event


class StepObserver:
    """What a guard tells about its steps; this one does nothing (no replay)."""

    replays: bool = False
    """whether this observer replays an incident: the replay is the verdict of its own (the guard
    re-runs nothing to judge it) and speaks to no coordinator"""
    step: int | None = None
    """the step the guard starts counting from (a replay's incident step), or None"""
    stepped: bool = False
    """whether the first step is decided at an optimizer step even before one is seen"""
    nested: Callable[[], bool] = staticmethod(lambda: False)
    """whether a guarded root's forward is in progress (set by the guard)"""

    def forensic(self, settings: Settings) -> Settings:
        """The guard's settings for what is observed."""
        return settings

    def model_attached(self, root: nn.Module, param_names: dict[int, str], prefix: str = "") -> None:
        """``root`` (with parameters) is now guarded; its names begin with ``prefix`` (empty for
        the first such root, the model)."""

    def optimizers(self, optimizers: Sequence[torch.optim.Optimizer], states: dict[str, Any]) -> None:
        """The guard met these optimizers (and scaler, scheduler states)."""

    def first_call(self, root: nn.Module, args: tuple) -> tuple | None:
        """The first forward of a root found by a bare ``init()``: arguments to use instead, or None."""
        return None

    def decided(self, event: Event | None) -> None:
        """A step was decided: its job's first event, or None when it was clean."""

    def batch_given(self, root: nn.Module, batch: Any) -> None:
        """A micro-batch of ``root`` begins with ``batch`` (``Guard.begin_micro_batch``)."""
