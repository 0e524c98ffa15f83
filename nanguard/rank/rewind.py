"""Putting an optimizer's parameters and state back as they were when its step began.

An optimizer that calls its closure several times in one step (LBFGS: its inner iterations and
line search) updates the weights between the calls. A value found bad in a later call is found
after updates of the very step that is not to happen: the capture ("the state from before the
step") and a skipped step must not keep them. A snapshot taken once the first call was found
clean (the weights untouched yet) puts them back. It costs one copy of the parameters and of
the optimizer's state per step, for those optimizers only: LBFGS keeps a hundred such copies
in its own history.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .modules import params
from .._torch.patches import wrap_closure

log = logging.getLogger("nanguard")


class Rewind:
    """The parameters and the state of ``optimizer`` as they are now."""

    def __init__(self, optimizer: torch.optim.Optimizer, loss: Any = None):
        self.loss = loss.detach().clone() if isinstance(loss, torch.Tensor) else loss
        """the closure's first loss, the step's start's: what the optimizer gets once a later call is skipped"""
        self.restored = False
        with torch.no_grad():
            self._params = [(p, p.detach().clone()) for p in params(optimizer)]
            self._state = {p: {k: _copied(v) for k, v in s.items()} for p, s in optimizer.state.items()}

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put them back, in place where the optimizer's step still holds them (its history lists,
        tensors it updates in place), so that a step that goes on after this keeps them."""
        self.restored = True
        with torch.no_grad():
            for param, saved in self._params:
                param.copy_(saved)
            for param in [p for p in optimizer.state if p not in self._state]:
                del optimizer.state[param]
            for param, saved in self._state.items():
                _put_back(optimizer.state[param], saved)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Put them back again once the step ends (a skipped step goes on: the optimizer writes
        the state of its inner iterations at its end)."""
        handle = None

        def again(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            handle.remove()
            self.restore(opt)

        handle = optimizer.register_step_post_hook(again)


def closure_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict,
                 decide: Callable[[bool, Rewind | None], None],
                 several: weakref.WeakSet[torch.optim.Optimizer]) -> tuple[tuple, dict] | None:
    """The step's arguments with its closure wrapped (``patches.wrap_closure``) to call
    ``decide(first, rewind)`` after each call: ``rewind`` is the state as the step began, for a
    later call of an optimizer that calls its closure several times (LBFGS, or one seen to, in
    ``several``). A later call whose step is skipped hands the optimizer the first call's loss,
    with the gradients gone: its line search goes on from finite values (a NaN loss breaks
    LBFGS's strong-Wolfe search), and what it does is put back when the step ends. None without
    a closure."""
    rewind: Rewind | None = None

    def after(first: bool, loss: Any) -> Any:
        nonlocal rewind
        if not first and rewind is None and optimizer not in several:
            several.add(optimizer)  # from its next step on, a snapshot is taken
            log.info("nanguard: %s calls its closure several times in one step: a value found bad in a"
                        " later call comes after this step's first updates, which are put back from its next"
                        " step on", type(optimizer).__name__)
        decide(first, None if first else rewind)
        if first and (isinstance(optimizer, torch.optim.LBFGS) or optimizer in several):
            rewind = Rewind(optimizer, loss)
        return rewind.loss if not first and rewind is not None and rewind.restored else loss

    return wrap_closure(args, kwargs, after)


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return list(value) if isinstance(value, list) else value


def _put_back(state: dict, saved: dict) -> None:
    for key in [k for k in state if k not in saved]:
        del state[key]
    for key, value in saved.items():
        now = state.get(key)
        if isinstance(value, list) and isinstance(now, list):
            now[:] = value
        elif isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and now.shape == value.shape:
            now.copy_(value)
        else:
            state[key] = _copied(value)
