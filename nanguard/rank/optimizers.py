"""Which optimizers a guard decides at: those given to ``init`` (each with a step pre-hook of its
own), and any other whose step would update the guarded models' parameters (one re-created after
``init``, one made later for a second phase of training, a bare ``init()``'s), found by one
process-wide step pre-hook. An optimizer of another model (another guard's, or no guard's) is left
alone: deciding there would read gradients this guard cannot name; a bare ``init()``'s guard, which
decides at every other optimizer, leaves one that steps only another open guard's models to that guard."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .modules import local_optimizer

log = logging.getLogger("nanguard")

StepHook = Callable[[torch.optim.Optimizer, tuple, dict], Any]


class OptimizerWatch:
    """Installs the step pre-hooks that call ``on_step`` for this guard's optimizers.
    ``param_names``: the guarded models' parameters by id (``Catalog.param_names``, which grows
    as models are attached), and ``guarded(param)``, whether a parameter is one of them (itself,
    not a tensor that took a freed one's id); ``everything``: a bare ``init()``'s guard, which
    decides at every optimizer (a model it never saw, compiled in place, still has its gradients
    checked)."""

    def __init__(self, given: Sequence[torch.optim.Optimizer], param_names: dict[int, str], on_step: StepHook,
                 guarded: Callable[[torch.Tensor], bool], everything: bool = False,
                 on_other: Callable[[torch.optim.Optimizer], None] | None = None,
                 elsewhere: Callable[[list[torch.Tensor]], bool] = lambda params: False,
                 generation: Callable[[], int] = lambda: 0):
        self._given: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet(given)
        self._inner: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet(
            local_optimizer(o) for o in given if local_optimizer(o) is not o)
        """the optimizers that step inside one decided at (a ZeroRedundancyOptimizer's local one): its steps"""
        self._names = param_names
        self._guarded = guarded
        self._on_step = on_step
        self._everything = everything
        self._elsewhere = elsewhere
        """whether parameters are all another open guard's (``everything``: that guard decides at their steps)"""
        self._generation = generation
        """counts the guards' claims and releases: what ``elsewhere`` said is judged again when it moves"""
        self._on_other = on_other if not given and not everything else None
        """told of the steps of other models' optimizers, by a guard with none of its own (a
        teacher's beside its student): its events carry the training step they happened in"""
        self._announce = bool(given)  # (an optimizer found under a bare init() is the expected one)
        self._verdicts: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[bool, int, int]] = \
            weakref.WeakKeyDictionary()
        """whether an optimizer steps guarded parameters, with what that was judged on (how many
        parameters were guarded, how many groups it had): judged again when either grows"""

    def install(self) -> list[Any]:
        """The hooks' handles. The process-wide hook holds this watch weakly: a guard that was never
        closed goes with its models and optimizers, which hold it (``Guard``), and its hook with it."""
        handles = [optimizer.register_step_pre_hook(self._on_step) for optimizer in self._given]
        watch = weakref.ref(self)

        def any_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
            me = watch()
            return None if me is None else me._any(optimizer, args, kwargs)

        return handles + [register_optimizer_step_pre_hook(any_step)]

    def _any(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        if optimizer in self._given or optimizer in self._inner:
            return None  # its own hook decides, or the one it steps inside did
        if self._steps_guarded(optimizer):
            if local_optimizer(optimizer) is not optimizer:
                self._inner.add(local_optimizer(optimizer))
            return self._on_step(optimizer, args, kwargs)
        if self._on_other is not None:  # another model's: not this guard's to decide at
            self._on_other(optimizer)
        return None

    def _steps_guarded(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this guard decides at ``optimizer``'s steps (judged once, and again when the guarded
        parameters, its groups or the guards' claims change)."""
        basis = (len(self._names), len(optimizer.param_groups), self._generation())
        verdict = self._verdicts.get(optimizer)
        if verdict is not None and verdict[1:] == basis:
            return verdict[0]
        stepped = [param for group in optimizer.param_groups for param in group["params"]]
        if self._everything:
            guarded = not self._elsewhere(stepped)
            if not guarded:
                log.info("nanguard: the process-wide guard leaves the steps of %s, which updates only another"
                         " guard's model, to that guard", type(optimizer).__name__)
        else:
            guarded = any(map(self._guarded, stepped))
        self._verdicts[optimizer] = (guarded, *basis)
        if guarded and self._announce:
            log.warning("nanguard: an optimizer not given to nanguard.init (%s) steps the guarded model's"
                        " parameters (re-created after init, say): its steps are decided from now on",
                        type(optimizer).__name__)
        return guarded
