"""Replay: the ``StepObserver`` (``nanguard.rank.observer``) that listens to a guard's steps and replays
an incident's step."""

from __future__ import annotations

import atexit
import contextlib
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
from ..events import Event, within
from ..incident import Incident, IncidentError
from ..incident.fsio import write_json
from ..incident.replay_lines import render
from ..incident.rng import host_fingerprint
from ..rank import forensics
from ..rank.hooks import skipped
from ..rank.modules import NON_PERSISTENT, is_wrapper, non_persistent_buffers, plain_names, type_name, untraced, unwrap
from ..rank.observer import StepObserver
from . import devices, layout, samples
from .fill import fill, incomplete
from .load import (check_model_state, load_into, load_optimizer, load_other_model, load_states, refuse_a_later_optimizer,
                   unpersisted)
from .ops import OpWatch
from .report import build_report
from .skipfile import SKIP, skip_record
from .trace import Trace

log = logging.getLogger("nanguard")

_FORENSIC_DETAIL_MB = 2.0**20  # keep every checked tensor of the one replayed step


class Replay(StepObserver):
    """One rank's replay of an incident: ``layout.part`` is the incident's rank it replays."""

    replays = True

    def __init__(self, incident: Incident, part: layout.Layout, rank: int, world: int, settings: Settings):
        self.incident = incident
        self.layout = part
        self.rank = part.part
        self.process_rank = rank
        self.world = world
        self.settings = settings
        self.device = devices.parse(settings.replay_device)
        # the whole incident is checked before anything changes: the report reads this after the step
        incident.environment(incident.first_event.rank)
        self.state = incident.rank_state(self.rank)
        refuse_a_later_optimizer(self.state.get("extra"), self._state_path)
        self.notes: list[str] = [part.note] if part.note else []
        self.batches = incident.rank_batches(self.rank, self.notes)
        self.rng = incident.rank_rng(self.rank)
        self.forwards = 0
        self._handed_over = False
        """a trainer handed the batch over (``batch_given``): its training_step takes it, not the model"""
        self.own_data = False
        """some of what the step was fed came from the script, not from the incident"""
        self.bad_state: list[str] = []
        """the model's captured tensors that were non-finite already (before the step)"""
        self.finished = False
        self._used: samples.UsedOutputs | None = None  # (made at ``_install``)
        self._host_rng: tuple | None = None
        """Python's and numpy's random states as the step's first forward began (``host_fingerprint``)"""
        self.other_script = False
        """the script's model is not the one that made the incident (its module types differ)"""
        self.autocast: list[tuple[str, torch.dtype]] = []
        """the autocast regions the step's first forward ran in (the sample search runs in them too)"""
        self._others: dict[str, int] = {}
        """forwards so far of the models beside the first (a bare init()'s other roots), by prefix"""
        micro_batch = lambda name: _forward_of(self._others, self.forwards, name)  # noqa: E731
        self.ops = OpWatch(micro_batch) if settings.replay_ops else None
        self.trace = Trace(micro_batch, self.ops.paused if self.ops is not None else
                           contextlib.nullcontext)
        self._root: nn.Module | None = None
        self._skipped: set[str] = set()
        self.model_loaded = False
        self._optimizers_loaded = False
        self._names: dict[int, str] = {}
        self._loaded: set[int] = set()  # ids of the model tensors loaded so far
        self._handles: list[Any] = []
        if not incident.manifest["capture_batch"]:
            self.notes.append("the batch was not captured (capture_batch=False): the replay used the"
                              " script's own first batch, so it says little about the data")
        if self.ops is None:
            self.notes.append("operations were not checked (replay_ops=False): the trace names modules only")

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, settings: Settings, rank: int, world: int) -> Replay:
        """Reads and checks the incident (every file's sha256) and the part this process replays."""
        incident = capture.read_incident(settings.replay)
        return cls(incident, layout.choose(incident, rank, world, settings.replay_rank), rank, world, settings)

    def forensic(self, settings: Settings) -> Settings:
        """The guard's settings for the replayed step: every module probed, everything kept, nothing
        written, stop."""
        return dataclasses.replace(settings, detail_mb=_FORENSIC_DETAIL_MB, capture=False,
                                   on_nan="raise", grad_norm_warn=None, mode="full")

    @property
    def step(self) -> int:
        return self.incident.step

    @property
    def stepped(self) -> bool:
        """Whether the original step ended at an optimizer step (not at the end of a forward)."""
        return self.state.get("optimizer") is not None

    # ------------------------------------------------------------------ loading
    def model_attached(self, root: nn.Module, param_names: dict[int, str], prefix: str = "") -> None:
        """Loads the captured weights into the model inside ``root``'s wrappers (and moves it to
        NANGUARD_REPLAY_DEVICE) and hooks ``root`` for the replay; ``param_names``: qualified
        names by ``id(param)``, as reports use them. Another model (``prefix``: a GAN's critic, an
        EMA teacher) only gets its weights."""
        if prefix:
            self._load_other(root, prefix)
            return
        if self.model_loaded:
            return
        unwrapped = unwrap(root)
        check_model_state(unwrapped, self.state["model"], self._state_path)
        note = _other_script(self.incident.first_event, unwrapped)
        if note is not None:
            self.other_script = True
            self.notes.append(note)
        unpersisted = _unpersisted(self.state, unwrapped, self._state_path, self.notes)
        back = devices.move(root, self.device) if self.device is not None else None
        load_into(unwrapped, self.state["model"], unpersisted, self._loaded)  # (onto the replay's device)
        self.bad_state = [name for name, value in [*self.state["model"].items(), *unpersisted]
                          if isinstance(value, torch.Tensor) and not forensics.is_finite(value)]
        self.model_loaded = True
        self._root = root
        self._install(root, param_names, back)

    def _load_other(self, root: nn.Module, prefix: str) -> None:
        self._others[prefix] = 1  # found at its first call, which its hooks added now do not see
        self._handles.append(root.register_forward_pre_hook(
            untraced(lambda module, args: self._others.__setitem__(prefix, self._others[prefix] + 1))))
        self._handles += self.trace.install(root, self._names, prefix)
        if self.ops is not None:  # what runs in it is named by its module too
            self._handles += self.ops.install(root, _skipped_names(root, self.settings, prefix), prefix)
        if not load_other_model(self.state.get("extra"), prefix, unwrap(root), self._state_path, self._loaded):
            self.notes.append(f"the incident holds no weights of {prefix}, a model the script runs beside the"
                              " first one: the script's own were used")
        elif self.device is not None:
            self.notes.append(f"{prefix} stayed where the script put it (only the first model moves to"
                              " NANGUARD_REPLAY_DEVICE)")

    def optimizers(self, optimizers: Sequence[torch.optim.Optimizer], states: dict[str, Any]) -> None:
        """Loads the optimizer state into the first optimizer to step (the one whose step an
        incident stopped and saved: ``StepClock``), and the scaler's and scheduler's given to ``init``."""
        saved = self.state.get("optimizer")
        if optimizers and not self._optimizers_loaded and saved is not None:
            try:
                note = load_optimizer(optimizers[0], saved, self.state.get("extra"), self._names, self._state_path)
            except IncidentError:
                if self.ops is not None:
                    self.ops.stop()  # (started at the step's first forward: the replay ends here)
                raise
            self._optimizers_loaded = note is None
            if note is not None and note not in self.notes:
                self.notes.append(note)
        extra = self.state.get("extra") or {}
        # (never NON_PERSISTENT: init's states are its scaler and such)
        load_states({name: obj for name, obj in states.items() if name in extra}, extra, self._state_path)
        self.notes += [f"no {name} state was captured; the script's own {name} was used"
                       for name in states if name not in extra]

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
            if self.ops is not None:
                self.ops.stop()  # the replay ends here: leave no mode behind
            raise NanguardError(
                "NANGUARD_REPLAY: the captured batch passes tensors by keyword "
                f"({', '.join(sorted(new_kwargs))}), which a bare nanguard.init() cannot put into the"
                " first forward; call nanguard.init(model, optimizer) in the script for the replay")
        return new_args

    def _feed(self, root: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.nested():
            return None  # called inside another model's forward: a module there, fed by it
        index = self.forwards
        self.forwards += 1
        if index == 0:
            self.notes.extend(capture.rng_restore(self.rng))
            self._host_rng = host_fingerprint()
            self.autocast = samples.autocast_now()
            if self._used is not None:
                self._used.arm()  # the outputs of this forward that the step's loss backpropagates through
        fed = self._batch(root, index, args, kwargs)
        if index == 0 and self.ops is not None:
            self.ops.start()  # from the first forward to the decision: the step, and only it
        return fed

    def _batch(self, root: nn.Module, index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The captured micro-batch ``index``, completed from the script's call (``args``, ``kwargs``)
        where the incident lacks a value; None: the script's own."""
        if self.batches is None:
            self.own_data = True
            return None
        if index >= len(self.batches):
            if index == len(self.batches):
                self.notes.append(f"the script ran more forwards of the model than the {len(self.batches)}"
                                  " captured in this step; the extra ones used the script's inputs")
            self.own_data = True
            return None
        batch = capture.to_device(self.batches[index], devices.device_of(root))
        self.trace.bad_batch(batch, index)
        if incomplete(batch):
            self.own_data = True
            return tuple(fill(batch["args"], args)), dict(fill(batch["kwargs"], kwargs))
        return tuple(batch["args"]), dict(batch["kwargs"])

    def _install(self, root: nn.Module, param_names: dict[int, str], back: torch.device | None) -> None:
        self._names = param_names  # (the guard's: every root's, as they are attached)
        # first, so that the guard's own pre-hook sees (and checks) the captured batch; untraced, as
        # a model compiled in place runs it inside its compiled frame
        self._handles.append(root.register_forward_pre_hook(untraced(self._feed), with_kwargs=True, prepend=True))
        self._handles += self.trace.install(root, param_names)
        self._used = samples.UsedOutputs()  # (the sample search's backward goes into those only)
        self._handles.append(root.register_forward_hook(untraced(self._used)))
        self._skipped = _skipped_names(root, self.settings)
        if self.ops is not None:
            self._handles += self.ops.install(root, self._skipped)
        if back is not None:
            # last: every check sees the outputs where the model made them
            self._handles.append(root.register_forward_hook(devices.outputs_to(back)))
            self.notes.append(f"the model ran on {self.device} (NANGUARD_REPLAY_DEVICE); the script put it on"
                              f" {back}, where its outputs were handed back: the script's own loss ran there")

    # ------------------------------------------------------------------ the verdict
    def decided(self, event: Event | None) -> NoReturn:
        """Search the bad samples, compare with the original, write replay.json (process rank 0),
        print, and end the script."""
        self.finished = True
        notes = self.ops.stop() if self.ops is not None else []
        for handle in self._handles:
            handle.remove()
        unfed = _unfed_note(self.forwards, self.model_loaded, self.batches)
        if unfed is not None:  # what the step was fed is not all the incident holds
            self.own_data = True
            notes.append(unfed)
        if self.layout.alone and event is not None:
            event = dataclasses.replace(event, rank=self.rank)  # the rank whose part ran
        drawn = self._host_rng is not None and host_fingerprint() != self._host_rng
        payload = {"rank": self.rank, "trace": self.trace.records, "notes": self.notes + notes,
                   "own_data": self.own_data, "bad_state": self.bad_state, "host_rng_drawn": drawn,
                   "other_script": self.other_script,
                   "operations": self.ops.result() if self.ops is not None else None,
                   "samples": _search(self),
                   "device": devices.this_one(devices.device_of(self._root) if self._root is not None
                                              else torch.device("cpu"))}
        collectives = Collectives()
        traces = collectives.all_gather_object(payload)
        report = path = None
        if self.process_rank == 0:
            report, path = _report(self, event, traces)
        else:
            print(f"nanguard replay: rank {self.rank} done; rank 0 prints the report", flush=True)
        collectives.barrier()  # rank 0 has saved the report before any rank leaves
        raise ReplayFinished(report, path)

    def batch_given(self, root: nn.Module, batch: Any) -> None:
        """Fill the batch a trainer hands over with the captured micro-batch, in place (a trainer
        passes its own object on; only its contents can be replaced)."""
        self._handed_over = True
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


def watch_exit(replay: Replay) -> None:
    """The guard that replays is installed (nothing was refused): a script that ends before the
    replayed step is decided is told so at exit."""
    atexit.register(_never_decided, replay)


def _never_decided(replay: Replay) -> None:
    """At exit: a script that ended before the replayed step was decided (an empty loader, a step
    limit of 0, an error caught) replayed nothing, and wrote no report: said so."""
    if not replay.finished:
        log.error("nanguard: NANGUARD_REPLAY=%s: the script ended before the replayed step was decided (%s):"
                  " nothing was replayed, and no replay.json was written", replay.incident.path,
                  f"{replay.forwards} forward(s) of the model ran" if replay.model_loaded else
                  "the guarded model never ran a forward")


def _other_script(event: Event, model: nn.Module) -> str | None:
    """A note when the module the original event names is not of the type it was (a model of
    another class with the same weights' names and shapes is another script), else None."""
    modules = dict(model.named_modules())
    name = event.layer if event.layer in modules else event.layer.rpartition(".")[0]
    module = modules.get(name) if event.layer and event.module_type else None
    if module is None or type_name(module) == event.module_type:
        return None
    return (f"the script's {name or 'model'} is a {type_name(module)}, the incident's was a {event.module_type}:"
            " this is not the script that made the incident")


def _unfed_note(forwards: int, model_loaded: bool, batches: list[Any] | None) -> str | None:
    """Why the replayed step was not fed all the incident holds, or None."""
    if forwards == 0 and model_loaded:  # its modules were called directly (a GAN's G and D)
        return ("the model's root module ran no forward in this step (the script called its modules directly):"
                " no batch was captured or fed, the script's own inputs were used")
    if batches is not None and forwards < len(batches):
        return (f"the script ran {forwards} forward(s) of the model in this step, the incident captured"
                f" {len(batches)}: micro-batch(es) {forwards} to {len(batches) - 1} were never fed (replay with"
                " the run's gradient accumulation)")
    return None


def _search(replay: Replay) -> dict[str, Any]:
    """The bad samples of a replay's batch, or why they were not searched."""
    why = _not_searchable(replay._root, replay.batches, replay.incident.manifest["sharded"], replay.world,
                          replay._handed_over)
    if why is not None:
        return {"searched": False, "why_not": why}
    model = unwrap(replay._root)
    batches = [capture.to_device(b, devices.device_of(model)) for b in replay.batches]
    used = replay._used
    return samples.search(model, batches, replay.rng, key=replay.settings.sample_id_key, skipped=replay._skipped,
                          autocast=replay.autocast, outputs=used.indices() if used is not None else None)


def _report(replay: Replay, event: Event | None, traces: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """The report of every rank's trace, saved into the incident (with the skip file) and printed."""
    report = build_report(replay.incident, replay.world, event, traces, replay.layout)
    _skip_file(replay.incident, report, replay.settings.sample_id_key)
    path = None
    try:
        path = capture.record_replay(replay.incident.path, report)
    except IncidentError as exc:
        log.error("nanguard: replay report not saved: %s", exc)
    print(render(report, path), flush=True)
    return report, path


def _unpersisted(state: dict[str, Any], model: nn.Module, path: str, notes: list[str]) -> list[tuple[str, torch.Tensor]]:
    """The incident's values of the model's non-persistent buffers (``unpersisted``). An incident
    from before they were captured holds none: the script's own are used, and ``notes`` say so."""
    saved = (state.get("extra") or {}).get(NON_PERSISTENT)
    if saved is None:
        own = list(non_persistent_buffers(model))
        if own:
            notes.append(f"the incident holds no non-persistent buffers ({', '.join(own[:4])}): the script's"
                         " own were used")
        return []
    return unpersisted(saved, model, path)


def _forward_of(others: dict[str, int], first: int, name: str | None) -> int:
    """Which forward (0-based) of the model holding module or parameter ``name`` is running, or
    ran last: one of the ``others`` (forwards so far, by prefix), else the first model (``first``)."""
    other = next((p for p in others if name is not None and within(name, p)), None)
    return (others[other] if other is not None else first) - 1


def _skipped_names(root: nn.Module, settings: Settings, prefix: str = "") -> set[str]:
    """Names of the modules whose outputs may be non-finite on purpose, and of their children."""
    names = plain_names(root, prefix)
    top = [name for module, name in names.items()
           if skipped(module, name, settings.skip_types, settings.skip_modules)]
    return {name for name in names.values() if any(name == s or name.startswith(s + ".") for s in top)}


def _not_searchable(root: nn.Module | None, batches: list[Any] | None, sharded: str | None, world: int,
                    handed_over: bool = False) -> str | None:
    if batches is None:
        return "the batch was not captured (capture_batch=False)"
    if handed_over:
        return ("the batch came through begin_micro_batch (a Lightning training_step takes it, and calls the"
                " model's modules): the search runs the model's own forward on parts of a batch, which this"
                " batch is not made for")
    if incomplete(batches):
        return "the incident lacks part of the batch (see the notes), which the script's own values filled"
    if sharded:
        return f"the model is sharded ({sharded}): a part of the batch cannot run on one rank's shards alone"
    if root is None:
        return "no model with parameters was met in the replayed step"
    model = unwrap(root)
    if is_wrapper(model):
        return f"the model is wrapped by {type_name(model)}, whose forward runs more than the model"
    if world > 1 and any(isinstance(m, nn.SyncBatchNorm) and m.training for m in model.modules()):
        return "SyncBatchNorm in train mode needs every rank in each forward; ranks cannot search alone"
    return None


def _skip_file(incident: Incident, report: dict[str, Any], key: str | None) -> None:
    """Writes skip.json beside replay.json when bad samples with ids were found."""
    record = skip_record(incident.name, incident.step, key, report["bad_samples"]) if key else None
    if record is None:
        if report["bad_samples"] and key is None:
            report["notes"].append("no skip file: name the key of the model's input that holds sample ids"
                                   " (NANGUARD_SAMPLE_ID_KEY, or init(..., sample_id_key=...)) and replay again")
        return
    path = os.path.join(incident.path, SKIP)
    try:
        write_json(path, record)
    except OSError as exc:
        report["notes"].append(f"the skip file was not written to {path} ({exc.strerror})")
        return
    report["skip_file"] = path
