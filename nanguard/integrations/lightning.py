"""A Lightning ``Callback`` that guards a ``Trainer``'s model and optimizers with nanguard.

    from nanguard.integrations.lightning import NanguardCallback
    trainer = lightning.Trainer(callbacks=[NanguardCallback()])

The guard is installed when fitting starts (on the model as the strategy wrapped it, so DDP's
gradient buckets are watched too) and removed when fitting ends, with or without an error. Settings are
``nanguard.init`` keywords (``NanguardCallback(on_nan="skip")``) or ``NANGUARD_*`` variables.
Steps are counted as the trainer's ``global_step`` with one optimizer (a resumed fit goes on from
its checkpoint, which also keeps the guard's own state); with several (a GAN's manual
optimization) one step is an iteration, counted by the first optimizer to step, where Lightning
counts every optimizer's. Where no forward of the guarded model takes the batch
(one device: ``training_step`` calls submodules), the batch the trainer hands over is what an
incident captures, and what a replay fills with the captured one.
Lightning's automatic optimization runs the forward and backward inside
``optimizer.step(closure)``; the guard decides after that closure, before the update, so a
``NonFiniteError`` leaves the weights as they were before the bad step. With 16-bit mixed
precision the trainer's GradScaler is passed on, so steps it skips are still decided, and counted
as ``global_step`` counts them.
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
        self._loaded: dict[str, Any] | None = None
        self._takes_batch = True

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.guard is not None and not self.guard.closed:
            return
        model = getattr(trainer.strategy, "model", None) or pl_module
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.guard = nanguard.init(model, list(trainer.optimizers) or None, scaler=scaler, **self.overrides)
        # a wrapper (DDP) is called with the batch; the LightningModule alone is not
        self._takes_batch = model is not pl_module

    def on_train_start(self, trainer, pl_module) -> None:
        # the trainer's own state (global_step) is restored from a checkpoint only by now
        if self.guard is not None and self.guard.settings.replay is None:  # a replay counts from its incident
            self.guard.load_state_dict({**(self._loaded or {}), "step": trainer.global_step})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.guard is not None and not self._takes_batch:
            self.guard.begin_micro_batch(batch)

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict() if self.guard is not None else dict(self._loaded or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)  # applied when fitting starts, once the guard exists

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.guard is not None:
            self.guard.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # a fit that ends with an error (NonFiniteError among them) has no teardown call
        self.teardown(trainer, pl_module, "fit")
