"""A Hugging Face ``TrainerCallback`` that guards the model and optimizer a ``Trainer`` creates.

    from nanguard.integrations.transformers import NanguardCallback
    trainer = transformers.Trainer(model, args, train_dataset=..., callbacks=[NanguardCallback()])

The ``Trainer`` creates its optimizer and LR scheduler inside ``train()``, so a script cannot
pass them to ``nanguard.init``; this callback does, when training begins (``on_train_begin``
hands it the model, the optimizer and the scheduler). The scheduler is saved in incidents. The
batch is captured where the trainer hands it to the model (``model(**inputs)``). Settings are
``nanguard.init`` keywords (``NanguardCallback(on_nan="skip")``) or ``NANGUARD_*`` variables.

The guard is closed when training ends, and when it ends with nanguard's own error
(``NonFiniteError``, ``StopRequested``: through ``on_stop``, before the error leaves the step).
A ``TrainerCallback`` hears of no other exception: after one, the guard stays open until the next
``train()`` of the trainer (which closes it first) or ``callback.close()``.

A run resumed from a checkpoint (``train(resume_from_checkpoint=...)``) counts steps from the
trainer's global step, where the guard can be told (``Guard.load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("nanguard.integrations.transformers needs transformers: pip install transformers"
                      " (or pip install 'nanguard[realworld]')") from exc

import nanguard


def _torch_optimizer(optimizer: Any) -> Any:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` (the Trainer prepares its
    optimizer with accelerate): the wrapper's own step hooks are never called."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and type(optimizer).__name__ == "AcceleratedOptimizer" else optimizer


class NanguardCallback(TrainerCallback):
    """Guards the trainer's model and optimizer from the start of training to its end."""

    def __init__(self, **init_overrides: Any):
        super().__init__()
        from ..config import Settings

        overrides = dict(init_overrides)
        self.on_stop: Callable[[Exception], Any] | None = overrides.pop("on_stop", None)
        Settings.resolve(overrides)  # a wrong keyword fails here, not when training starts
        self.overrides = overrides
        self.guard: nanguard.Guard | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self.close()  # a guard left open by a train() that ended with another exception
        if model is None:
            return None
        optimizer = _torch_optimizer(optimizer) if optimizer is not None else None
        self.guard = nanguard.init(model, optimizer, scheduler=lr_scheduler, on_stop=self._stopping,
                                   **self.overrides)
        if state.global_step and hasattr(self.guard, "load_state_dict"):
            # a resumed run: steps count on from the trainer's
            self.guard.load_state_dict({**self.guard.state_dict(), "step": state.global_step})
        return None

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return None

    def close(self) -> None:
        """Close the guard (removes every hook). Idempotent."""
        if self.guard is not None:
            self.guard.close()

    def _stopping(self, error: Exception) -> None:
        # nanguard raises this error out of the trainer's step next: no on_train_end follows
        try:
            if self.on_stop is not None:
                self.on_stop(error)
        finally:
            self.close()
