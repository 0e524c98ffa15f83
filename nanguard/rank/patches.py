"""The two places where the guard wraps someone else's callable, each with its undo.

- ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) runs the forward and
  backward inside the step, after the step pre-hook: the decision must wait for the closure.
- A step that a GradScaler skips never calls ``optimizer.step()``, so the step pre-hook never
  decides it: the scaler's ``update()`` then has to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def wrap_closure(args: tuple, kwargs: dict, after: Callable[[bool, Any], Any]) -> tuple[tuple, dict] | None:
    """The arguments of an optimizer step pre-hook (``args`` holds the optimizer first) with the
    closure replaced by one that calls ``after(first, loss)`` once it has run and returns what that
    returns (the loss, or what the optimizer is to get instead); None without a closure.

    LBFGS calls the closure several times in one step: ``first`` is True only the first time.
    """
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        return None
    first = True

    def guarded_closure():
        nonlocal first
        loss = closure()
        count, first = first, False
        return after(count, loss)

    if "closure" in kwargs:
        return args, {**kwargs, "closure": guarded_closure}
    return (args[0], guarded_closure, *args[2:]), kwargs


def patch_scaler_update(scaler: Any, after: Callable[[], None]) -> Callable[[], None]:
    """Make ``scaler.update()`` call ``after()`` once it has run; returns the undo."""
    update = scaler.update

    def guarded_update(*args, **kwargs):
        result = update(*args, **kwargs)
        after()
        return result

    scaler.update = guarded_update
    return lambda: scaler.__dict__.pop("update", None)
