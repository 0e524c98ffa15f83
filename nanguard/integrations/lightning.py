"""A Lightning ``Callback`` that guards a ``Trainer``'s model and optimizers with nanguard.

    from nanguard.integrations.lightning import NanguardCallback
    trainer = lightning.Trainer(callbacks=[NanguardCallback()])

The guard is installed when fitting starts (on the model as the strategy wrapped it, so DDP's
gradient buckets are watched too) and removed when fitting ends, with or without an error. Settings are
``nanguard.init`` keywords (``NanguardCallback(on_nan="skip")``) or ``NANGUARD_*`` variables.
Lightning's automatic optimization runs the forward and backward inside
``optimizer.step(closure)``; the guard decides after that closure, before the update, so a
``NonFiniteError`` leaves the weights as they were before the bad step. With 16-bit mixed
precision the trainer's GradScaler is passed on, so steps it skips are still decided.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise ImportError("nanguard.integrations.lightning needs Lightning: pip install 'nanguard[lightning]'"
                          ) from exc

import nanguard


class NanguardCallback(Callback):
    """Guards the trainer's model and optimizers from the start of fitting to its teardown."""

    def __init__(self, **overrides: Any):
        super().__init__()
        from ..config import Settings

        Settings.resolve(overrides)  # a wrong keyword fails here, not when fitting starts
        self.overrides = overrides
        self.guard: nanguard.Guard | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.guard is not None and not self.guard.closed:
            return
        model = getattr(trainer.strategy, "model", None) or pl_module
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.guard = nanguard.init(model, list(trainer.optimizers) or None, scaler=scaler, **self.overrides)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.guard is not None:
            self.guard.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # a fit that ends with an error (NonFiniteError among them) has no teardown call
        self.teardown(trainer, pl_module, "fit")
