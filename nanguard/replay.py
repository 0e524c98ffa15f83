"""NANGUARD_REPLAY: run a captured step again, slowly and exactly, and say whether it reproduces.

The unchanged training script runs with ``NANGUARD_REPLAY=DIR``; ``nanguard.init`` then
- loads this rank's captured model, optimizer, GradScaler and LR-scheduler state (all checked
  against the script's objects before anything is copied, so nothing is loaded half-way);
- feeds the captured micro-batches to the root module in place of the loader's, and puts
  every RNG back as it was when the step began (so a dropout mask is drawn again the same);
- guards the step in forensic mode: every checked tensor is kept for an exact report, every
  module's output and every gradient that flows back into a module's output or reaches a
  parameter is checked synchronously, in the order it happens (the *trace*);
- at the optimizer step (before any update) compares the job's first event with the
  original one, writes ``replay.json`` into the incident, prints the report and raises
  ``ReplayFinished`` (a ``SystemExit`` with code 0), which ends the unchanged script there.

The guard calls a ``StepObserver`` at its few decision points whether or not a replay runs;
``Replay`` is the one that does something.

The verdict is ``reproducible`` when the same kind of event happens again in the same layer
at the same step: a deterministic bug in the model, the data or the code. Otherwise it is
``not_reproducible``, which points at the hardware that ran the original step (host and
device are named) or at non-determinism, as Megatron-LM's rerun machine reasons.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
import socket
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch import nn

from . import incident as capture
from ._dist import Collectives
from ._tree import floating_tensors
from .incident import Incident, IncidentError
from .config import Settings
from .errors import NanguardError, ReplayFinished
from .events import Event
from .rank import forensics
from .rank.modules import plain_names, unwrap

log = logging.getLogger("nanguard")

_TRACE_LIMIT = 16  # records per trace list: the first ones are what matter
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


class Replay(StepObserver):
    """One rank's replay of an incident."""

    def __init__(self, incident: Incident, rank: int, world: int):
        self.incident = incident
        self.rank = rank
        self.world = world
        self.state = incident.rank_state(rank)
        self.batches = incident.rank_batches(rank)
        self.rng = incident.rank_rng(rank)
        self.notes: list[str] = []
        self.trace: dict[str, list[dict[str, Any]]] = {"forward": [], "gradients": []}
        self._forwards = 0
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
        bad = next((t for t in floating_tensors(batch) if not forensics.is_finite(t)), None)
        if bad is not None:
            self._record("forward", {"module": "<the captured batch>", "module_type": "input",
                                     "micro_batch": index, "inputs_finite": False,
                                     "output": forensics.describe(bad)})
        return tuple(batch["args"]), dict(batch["kwargs"])

    def _install(self, root: nn.Module, param_names: dict[int, str]) -> None:
        def feed(module, args, kwargs):
            return self._feed(module, args, kwargs)

        # first, so that the guard's own pre-hook sees (and checks) the captured batch
        self._handles.append(root.register_forward_pre_hook(feed, with_kwargs=True, prepend=True))
        traced = set()
        for module, name in plain_names(root).items():
            if name not in traced:  # a wrapper (DDP) and the model it wraps share one name
                traced.add(name)
                self._handles.append(module.register_forward_hook(self._forward_trace(name)))
        for param in root.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(
                    self._param_trace(param_names.get(id(param), "?"))))

    # ------------------------------------------------------------------ the synchronous trace
    def _record(self, kind: str, entry: dict[str, Any]) -> None:
        records = self.trace[kind]
        if len(records) < _TRACE_LIMIT:
            records.append(entry)

    def _forward_trace(self, name: str):
        def hook(module, args, output):
            outputs = floating_tensors(output)
            bad = next((t for t in outputs if not forensics.is_finite(t)), None)
            if bad is not None:
                inputs = floating_tensors(args)
                self._record("forward", {
                    "module": name, "module_type": type(module).__name__, "micro_batch": self._forwards - 1,
                    "inputs_finite": all(forensics.is_finite(t) for t in inputs),
                    "output": forensics.describe(bad)})
            if torch.is_grad_enabled():
                for tensor in outputs:
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_trace(name))
            return None

        return hook

    def _grad_trace(self, name: str):
        def hook(grad):
            if not forensics.is_finite(grad):
                self._record("gradients", {"gradient_of": f"output of {name or '<root>'}",
                                           "micro_batch": self._forwards - 1, **forensics.describe(grad)})
            return None

        return hook

    def _param_trace(self, name: str):
        def hook(param):
            if param.grad is not None and not forensics.is_finite(param.grad):
                self._record("gradients", {"gradient_of": f"parameter {name}",
                                           "micro_batch": self._forwards - 1, **forensics.describe(param.grad)})

        return hook

    # ------------------------------------------------------------------ the verdict
    def decided(self, event: Event | None) -> NoReturn:
        """Compare with the original, write replay.json (rank 0), print, and end the script."""
        for handle in self._handles:
            handle.remove()
        collectives = Collectives()
        traces = collectives.all_gather_object({"rank": self.rank, "trace": self.trace, "notes": self.notes})
        report = path = None
        if self.rank == 0:
            report = self._report(event, traces)
            try:
                path = capture.record_replay(self.incident.path, report)
            except IncidentError as exc:
                log.error("nanguard: replay report not saved: %s", exc)
            print(render(report, path), flush=True)
        else:
            print(f"nanguard replay: rank {self.rank} done; rank 0 prints the report", flush=True)
        collectives.barrier()  # rank 0 has saved the report before any rank leaves
        raise ReplayFinished(report, path)

    def _report(self, event: Event | None, traces: list[dict[str, Any]]) -> dict[str, Any]:
        original = self.incident.first_event
        same = {"kind": event is not None and event.kind == original.kind,
                "layer": event is not None and event.layer == original.layer,
                "step": event is not None and event.step == original.step}
        reproducible = all(same.values())
        notes = sorted({note for t in traces for note in t["notes"]})
        suspect = self._suspect(original)
        devices = suspect["device"]
        if not torch.cuda.is_available() and devices not in ("cpu", None):
            notes.append(f"replayed on the CPU: the original ran on {devices}; GPU kernels do not give"
                         " bit-identical results, so a fault of a GPU kernel may not show here")
        where = f"{original.kind} event in {original.layer or 'the loss'} at step {original.step}"
        if reproducible:
            message = (f"the same {where} happened again with the captured weights, batch and random"
                       " state: a deterministic bug in the model, the data or the code (see the trace)")
        elif event is None:
            message = (f"the step ran clean with the captured weights, batch and random state, so the "
                       f"original {where} did not recur: suspect a transient fault of the hardware that ran"
                       f" it (host {suspect['host']}, device {devices}, rank {original.rank}), or"
                       " non-determinism (atomics in kernels, inputs from outside the captured batch)")
        else:
            message = (f"the replay found a different first event ({event}) than the original {where}:"
                       f" suspect non-determinism or the hardware of host {suspect['host']}"
                       f" (device {devices}, rank {original.rank})")
        return {
            "verdict": "reproducible" if reproducible else "not_reproducible",
            "message": message,
            "incident": self.incident.name,
            "step": self.incident.step,
            "world_size": self.world,
            "original_event": original.to_dict(),
            "first_event": event.to_dict() if event is not None else None,
            "same": same,
            "suspects": [] if reproducible else [suspect],
            "trace": {str(t["rank"]): t["trace"] for t in traces},
            "notes": notes,
            "replayed": {"host": socket.gethostname(), "python": platform.python_version(),
                         "torch": torch.__version__,
                         "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                         and torch.cuda.is_initialized() else "cpu",
                         "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        }

    def _suspect(self, original: Event) -> dict[str, Any]:
        try:
            env = self.incident.environment(original.rank)
        except IncidentError:
            env = {}
        devices = env.get("devices") or []
        current = env.get("current_device")
        device = (devices[current] if isinstance(current, int) and 0 <= current < len(devices)
                  else (", ".join(devices) if devices else "cpu"))
        return {"rank": original.rank, "host": env.get("host") or original.host or "?", "device": device}


def render(report: dict[str, Any], path: str | None) -> str:
    """The report as a few readable lines."""
    lines = [f"nanguard replay of {report['incident']} (step {report['step']}): {report['verdict']}",
             f"  {report['message']}",
             f"  original: {Event.from_dict(report['original_event'])}"]
    if report["first_event"] is not None:
        lines.append(f"  replayed: {Event.from_dict(report['first_event'])}")
    lines += ["  " + line for line in trace_lines(report)]
    lines += [f"  note: {note}" for note in report["notes"]]
    if path is not None:
        lines.append(f"  saved to {path}; `nanguard inspect {os.path.dirname(path)}` shows it")
    return "\n".join(lines)


def trace_lines(report: dict[str, Any], per_rank: int = 3) -> list[str]:
    """The first bad values the replay's synchronous trace met, per rank, forward then backward."""
    lines = []
    for rank, trace in sorted(report.get("trace", {}).items(), key=lambda kv: int(kv[0])):
        for entry in trace["forward"][:per_rank]:
            role = "producer" if entry["inputs_finite"] else "propagator"
            lines.append(f"rank {rank} forward: {entry['module'] or '<root>'} ({entry['module_type']},"
                         f" {role}, micro-batch {entry['micro_batch']}): {_stats(entry['output'])}")
        for entry in trace["gradients"][:per_rank]:
            lines.append(f"rank {rank} backward: gradient of {entry['gradient_of']}: {_stats(entry)}")
    return lines


def _stats(d: dict[str, Any]) -> str:
    return (f"{d.get('bad_count')} bad of shape {d.get('shape')}, first at {d.get('first_index')}"
            f" = {d.get('first_value')}")

