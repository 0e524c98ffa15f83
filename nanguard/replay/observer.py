"""StepObserver, and Replay: what a guard tells of its steps, and the replay that listens."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch import nn

from .. import incident as capture
from .._dist import Collectives
from .._tree import floating_tensors, tensors
from ..config import Settings
from ..errors import NanguardError, ReplayFinished
from ..events import Event
from ..incident import Incident, IncidentError
from ..rank.modules import unwrap
from .report import build_report, render
from .trace import Trace

log = logging.getLogger("nanguard")

_FORENSIC_DETAIL_MB = 2.0**20  # keep every checked tensor of the one replayed step


def _device_of(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _check_model_state(model: nn.Module, state: dict[str, Any], path: str) -> None:
    """Refuse a state that does not fit ``model`` before a single tensor is copied into it."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [k for k in expected if k in state and isinstance(state[k], torch.Tensor)
              and tuple(state[k].shape) != tuple(expected[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
    if shapes:
        problems.append("other shapes for " + ", ".join(
            f"{k} {list(state[k].shape)} vs {list(expected[k].shape)}" for k in shapes[:5]))
    if problems:
        raise IncidentError(path, f"does not fit the script's model {type(model).__name__} "
                                  f"({'; '.join(problems)}); nothing was loaded. Replay with the "
                                  "script and model configuration that made the incident")


class StepObserver:
    """What a guard tells about its steps; this one does nothing (no replay)."""

    step: int | None = None
    """the step the guard starts counting from (a replay's incident step), or None"""
    stepped: bool = False
    """whether the first step is decided at an optimizer step even before one is seen"""

    def forensic(self, settings: Settings) -> Settings:
        """The guard's settings for what is observed."""
        return settings

    def model_attached(self, root: nn.Module, param_names: dict[int, str]) -> None:
        """``root`` (with parameters) is now guarded."""

    def optimizers(self, optimizers: Sequence[torch.optim.Optimizer], states: dict[str, Any]) -> None:
        """The guard met these optimizers (and scaler, scheduler states)."""

    def first_call(self, root: nn.Module, args: tuple) -> tuple | None:
        """The first forward of a root found by a bare ``init()``: arguments to use instead, or None."""
        return None

    def decided(self, event: Event | None) -> None:
        """A step was decided: its job's first event, or None when it was clean."""

    def batch_given(self, root: nn.Module, batch: Any) -> None:
        """A micro-batch of ``root`` begins with ``batch`` (``Guard.begin_micro_batch``)."""


class Replay(StepObserver):
    """One rank's replay of an incident."""

    def __init__(self, incident: Incident, rank: int, world: int):
        self.incident = incident
        self.rank = rank
        self.world = world
        self.state = incident.rank_state(rank)
        self.notes: list[str] = []
        self.batches = incident.rank_batches(rank, self.notes)
        self.rng = incident.rank_rng(rank)
        self._forwards = 0
        self.trace = Trace(lambda: self._forwards - 1)
        self._model_loaded = False
        self._optimizers_loaded = False
        self._handles: list[Any] = []
        if not incident.manifest["capture_batch"]:
            self.notes.append("the batch was not captured (capture_batch=False): the replay used the"
                              " script's own first batch, so it says little about the data")

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str, rank: int, world: int) -> Replay:
        """Reads and checks the incident (every file's sha256) and this rank's part of it."""
        incident = capture.read_incident(path)
        if world != incident.world_size:
            how = ("python SCRIPT" if incident.world_size == 1 else
                   f"torchrun with {incident.world_size} processes in all (for example "
                   f"--nproc-per-node {incident.world_size})")
            raise IncidentError(incident.path, f"was captured on {incident.world_size} rank(s) and this "
                                               f"process is one of {world}; replay it with {how}")
        return cls(incident, rank, world)

    def forensic(self, settings: Settings) -> Settings:
        """The guard's settings for the replayed step: keep everything, write nothing, stop."""
        return dataclasses.replace(settings, detail_mb=_FORENSIC_DETAIL_MB, capture=False,
                                   on_nan="raise", grad_norm_warn=None)

    @property
    def step(self) -> int:
        return self.incident.step

    @property
    def stepped(self) -> bool:
        """Whether the original step ended at an optimizer step (not at the end of a forward)."""
        return self.state.get("optimizer") is not None

    # ------------------------------------------------------------------ loading
    def model_attached(self, root: nn.Module, param_names: dict[int, str]) -> None:
        """Loads the captured weights into the model inside ``root``'s wrappers and hooks ``root``
        for the replay; ``param_names``: qualified names by ``id(param)``, as reports use them."""
        if self._model_loaded:
            return
        unwrapped = unwrap(root)
        _check_model_state(unwrapped, self.state["model"], self._state_path)
        with torch.no_grad():
            unwrapped.load_state_dict(self.state["model"])
        self._model_loaded = True
        self._install(root, param_names)

    def optimizers(self, optimizers: Sequence[torch.optim.Optimizer], states: dict[str, Any]) -> None:
        """Loads the first optimizer's state once it is known (a bare ``init()`` meets it at its
        first step), and the scaler's and scheduler's given to ``init``."""
        saved = self.state.get("optimizer")
        if optimizers and not self._optimizers_loaded:
            self._optimizers_loaded = True
            if saved is not None:
                self._load_optimizer(optimizers[0], saved)
        extra = self.state.get("extra") or {}
        for name, obj in states.items():
            if name in extra:
                obj.load_state_dict(extra[name])
            else:
                self.notes.append(f"no {name} state was captured; the script's own {name} was used")

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        if len(saved.get("param_groups", ())) != len(optimizer.param_groups):
            raise IncidentError(self._state_path, f"holds an optimizer state with {len(saved['param_groups'])}"
                                                  f" parameter group(s); the script's {type(optimizer).__name__}"
                                                  f" has {len(optimizer.param_groups)}; nothing was loaded")
        try:
            optimizer.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise IncidentError(self._state_path, f"its optimizer state does not fit the script's "
                                                  f"{type(optimizer).__name__} ({exc})") from exc

    @property
    def _state_path(self) -> str:
        return os.path.join(self.incident.path, f"rank{self.rank}", capture.STATE)

    # ------------------------------------------------------------------ feeding the step
    def first_call(self, root: nn.Module, args: tuple) -> tuple | None:
        """The first forward of a root found by a bare ``init()``: its hooks only fire from the
        next call on, and a process-wide hook can replace positional arguments only."""
        new = self._feed(root, args, {})
        if new is None:
            return args
        new_args, new_kwargs = new
        if floating_tensors(new_kwargs) or any(isinstance(v, torch.Tensor) for v in new_kwargs.values()):
            raise NanguardError(
                "NANGUARD_REPLAY: the captured batch passes tensors by keyword "
                f"({', '.join(sorted(new_kwargs))}), which a bare nanguard.init() cannot put into the"
                " first forward; call nanguard.init(model, optimizer) in the script for the replay")
        return new_args

    def _feed(self, root: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        index = self._forwards
        self._forwards += 1
        if index == 0:
            self.notes.extend(capture.rng_restore(self.rng))
        if self.batches is None:
            return None
        if index >= len(self.batches):
            if index == len(self.batches):
                self.notes.append(f"the script ran more forwards of the model than the {len(self.batches)}"
                                  " captured in this step; the extra ones used the script's inputs")
            return None
        batch = capture.to_device(self.batches[index], _device_of(root))
        self.trace.bad_batch(batch, index)
        return tuple(batch["args"]), dict(batch["kwargs"])

    def _install(self, root: nn.Module, param_names: dict[int, str]) -> None:
        def feed(module, args, kwargs):
            return self._feed(module, args, kwargs)

        # first, so that the guard's own pre-hook sees (and checks) the captured batch
        self._handles.append(root.register_forward_pre_hook(feed, with_kwargs=True, prepend=True))
        self._handles += self.trace.install(root, param_names)

    # ------------------------------------------------------------------ the verdict
    def decided(self, event: Event | None) -> NoReturn:
        """Compare with the original, write replay.json (rank 0), print, and end the script."""
        for handle in self._handles:
            handle.remove()
        collectives = Collectives()
        traces = collectives.all_gather_object({"rank": self.rank, "trace": self.trace.records,
                                                "notes": self.notes})
        report = path = None
        if self.rank == 0:
            report = build_report(self.incident, self.world, event, traces)
            try:
                path = capture.record_replay(self.incident.path, report)
            except IncidentError as exc:
                log.error("nanguard: replay report not saved: %s", exc)
            print(render(report, path), flush=True)
        else:
            print(f"nanguard replay: rank {self.rank} done; rank 0 prints the report", flush=True)
        collectives.barrier()  # rank 0 has saved the report before any rank leaves
        raise ReplayFinished(report, path)

    def batch_given(self, root: nn.Module, batch: Any) -> None:
        """Fill the batch a trainer hands over with the captured micro-batch, in place (a trainer
        passes its own object on; only its contents can be replaced)."""
        new = self._feed(root, (batch,), {})
        if new is None:
            return
        given, captured = tensors(batch), tensors(new[0][0] if new[0] else None)
        if [t.shape for t in given] != [t.shape for t in captured]:
            raise NanguardError("NANGUARD_REPLAY: the batch the trainer gave has other tensors or shapes"
                                f" ({[list(t.shape) for t in given]}) than the captured one"
                                f" ({[list(t.shape) for t in captured]}); nothing was fed. Replay with the"
                                " same data loader settings (batch size) as the run that made the incident")
        with torch.no_grad():
            for target, source in zip(given, captured):
                target.copy_(source)
