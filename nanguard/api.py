"""``nanguard.init``: the one entry point, and the one place that joins the two sides.

The rank side (``rank/``) guards; the replay (``replay/``) builds on it, and the guard knows it
only as a ``StepObserver``. Which observer a guard gets, a replay of ``NANGUARD_REPLAY`` or the
one that does nothing, is chosen here, so that the rank side never imports the replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ._dist import Collectives
from .config import Settings
from .errors import ConfigError
from .rank.guard import Guard, forget_gone, init_arguments, start

__all__ = ["Guard", "init"]


def init(model: nn.Module | None = None,
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
         *, on_stop: Callable[[Exception], Any] | None = None, scaler: Any = None,
         scheduler: Any = None, **overrides: Any) -> Guard:
    """Guard ``model`` and ``optimizer``; with no model, every module and optimizer of the process.

    Settings come from ``overrides``, else ``NANGUARD_*`` variables, else defaults (see
    ``nanguard.config.Settings``). ``on_stop(error)`` is called on every rank at the common
    stop step, before the error is raised, for a checkpoint in the team's own format.
    ``scaler`` (a GradScaler) and ``scheduler`` (an LR scheduler) are saved in incidents too.
    """
    forget_gone()
    settings = Settings.resolve(overrides)
    optimizers, states = init_arguments(model, optimizer, on_stop, scaler, scheduler)
    replay = None
    if settings.replay is not None:
        if settings.disable:
            raise ConfigError("NANGUARD_REPLAY and NANGUARD_DISABLE are both set: a replay needs the"
                              " guard; unset one of them")
        try:  # (a replay only: its op checks subclass torch's private dispatch mode)
            from .replay import Replay
        except ImportError as exc:
            raise ConfigError(f"NANGUARD_REPLAY is set, but this torch ({torch.__version__}) lacks what a replay's op"
                              f" checks need ({exc}): nothing was replayed; replay with the torch the incident"
                              " was made with (its rank folders' environment.json)") from exc

        # checks the whole incident before touching anything
        collectives = Collectives()
        replay = Replay.open(settings, collectives.rank, collectives.world_size)
        settings = replay.forensic(settings)
    guard = start(model, optimizers, settings, on_stop, states, replay)
    if replay is not None:
        from .replay import watch_exit

        watch_exit(replay)
    return guard
