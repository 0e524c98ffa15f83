"""Guard: installs the detector, wires it to the optimizer step, and runs each step's decision.

Once per optimizer step, in the optimizer's step pre-hook, the decision (``decision.py``) reads
the step's probes once; a clean step tells the reporter and the gradient-norm monitor; a bad one
is diagnosed (``diagnose.py``), agreed on by every rank and handled by the ``on_nan`` policy
(``respond.py``). The reporter (coordinator link) and the step observer (replay) are always
there; without a coordinator or a replay they do nothing.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from .._dist import Collectives, RankInfo, settle_gloo_workers
from ..config import Settings
from ..errors import GuardClosedError, NanguardError
from ..events import Event, RecentEvents
from ..incident import rng_snapshot
from . import ending, outcome, resume
from .clock import StepClock
from .decision import Decider
from .detector import Detector
from .records import StepLog
from .modules import ddp_inner, unwrap_optimizer
from .observer import StepObserver
from .optimizers import OptimizerWatch
from .._torch.patches import patch_scaler_update
from .reporter import Reporter, connect
from .respond import Responder, models_to_save, step_inputs
from .rewind import Rewind, closure_step

_log = logging.getLogger("nanguard")


class Guard:
    """The per-process detector for one model (or, from a bare ``init()``, every model)."""

    def __init__(self, model: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer],
                 settings: Settings, on_stop: Callable[[Exception], Any] | None = None,
                 states: dict[str, Any] | None = None, observer: StepObserver | None = None,
                 collectives: Collectives | None = None, reporter: Reporter | None = None):
        self.settings = settings
        self._closed = False
        self._scoped = model is not None
        self._handles: list[Any] = []
        self._undo: list[Callable[[], Any]] = []  # what is not a hook handle
        self._several: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # (``closure_step``)
        self._roots: list[tuple[Callable[[], nn.Module | None], str]] = []
        """(root, the prefix of its names), in the order they were attached"""
        self._rng: dict[str, Any] | None = None
        self._identity = RankInfo.from_env()
        self._collectives = collectives or Collectives()
        self._clock = StepClock(optimizer_seen=bool(optimizers))
        self._skipped_in_a_row, self._run_told = 0, False  # (steps a GradScaler skipped; that run warned of)
        self._observer = observer or StepObserver()
        self._events = RecentEvents(settings.max_events)
        sentinel = settings.mode == "sentinel"
        verdict = not self._observer.replays  # (a replay is the verdict of its own)
        saves_batches = settings.capture is not False and settings.capture_batch
        self._detector = Detector(skip_types=settings.skip_types, skip_modules=settings.skip_modules,
                                  detail_bytes=int(settings.detail_mb * 2**20),
                                  on_root_end=self._on_root_end,
                                  on_step_start=self._on_step_start if settings.capture is not False else None,
                                  keep_batches=saves_batches or verdict, sentinel=sentinel, verdict=verdict,
                                  on_settle=lambda apart: self._decider.settle_early(apart),
                                  outputs_decide=lambda: not self._clock.optimizer_seen)
        if reporter is None:
            wanted = settings.coordinator is not None and not settings.disable
            reporter = (connect(settings, self._identity, self._collectives)
                        if wanted and not self._observer.replays else Reporter())
        self._reporter = reporter
        self._respond = Responder(settings, self._identity, self._collectives, self._reporter, self._events,
                                  dict(states or {}), on_stop,
                                  lambda: models_to_save(self._roots, self._detector.catalog),
                                  lambda model: step_inputs(self._detector, model, _step_rng(self._rng, self._detector.log), saves_batches),
                                  self._detector.catalog.param_name, self._detector.buffers)
        self._respond.model_gone = lambda: any(root() is None for root, _ in self._roots)
        self._respond.step_part = lambda: self._clock.part
        self._respond.guarded_params = self._detector.backward.params
        self._observer.nested = lambda: self._detector.depth > 0
        self._decider = Decider(settings, self._detector, self._collectives, self._clock, self._identity,
                                self._respond, self._observer)
        # A guard is held by its models' and optimizers' hooks (and a bare init()'s by the process):
        # one never closed goes with them, and takes its process-wide hooks and its link along
        self._finalizer = weakref.finalize(self, _let_go, self._handles, self._detector.registrations, self._reporter,
                                           id(self))
        if settings.disable:
            return
        self._start(model, optimizers)

    def _start(self, model: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        observer = self._observer
        if observer.step is not None:
            self._clock.step = self._clock.index = observer.step
            # the original step was decided at an optimizer step, not at the end of a forward
            self._clock.optimizer_seen = self._clock.optimizer_seen or observer.stepped
        # (an optimizer's state is loaded at its first step: the first to step is the one captured)
        observer.optimizers([], self._respond.states)
        if "scaler" in self._respond.states:
            self._undo.append(patch_scaler_update(self._respond.states["scaler"], self._after_scaler_update))
            # scaled until the scaler unscales them: their norms as applied make the series
            self._detector.backward.scaled = True
        if model is not None:
            self._attach(model)
        else:
            self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._discover))
        self._watch = OptimizerWatch(optimizers, self._detector.catalog.param_names, self._on_step,
                                     self._detector.backward.watches, everything=model is None,
                                     on_other=self._on_other_step, elsewhere=partial(REGISTRY.all_elsewhere, self),
                                     generation=REGISTRY.generation)
        self._handles += self._watch.install()  # (kept: the process-wide hook holds the watch weakly)

    # ------------------------------------------------------------------ public surface
    @property
    def step(self) -> int:
        """Optimizer steps seen, a refused one and one a GradScaler skipped included (with several
        optimizers, the steps of the first one to step, the others' steps belonging to its last:
        ``StepClock``); between steps, the 0-based index of the next step. Events carry the index
        of the step they happened in."""
        return self._clock.step

    @property
    def events(self) -> list[Event]:
        """The most recent events, oldest first (at most ``max_events``)."""
        return self._events.snapshot()

    @property
    def incident(self) -> str | None:
        """The last captured incident directory, or None."""
        return self._respond.incident

    @property
    def skipped_steps(self) -> int:
        """Updates dropped by ``on_nan="skip"``."""
        return self._respond.skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The total gradient norm read at the last step (rank-local)."""
        return self._respond.last_grad_norm

    @property
    def last_param_grad_norms(self) -> dict[str, float]:
        """Per-parameter gradient norms of the last clean step, with ``param_grad_norms=True``."""
        return self._respond.last_param_grad_norms

    @property
    def closed(self) -> bool:
        return self._closed

    def check(self, tensor: torch.Tensor, name: str = "loss") -> None:
        """Check a tensor computed outside any module (the loss) at the next decision; no sync."""
        if self._closed:
            raise GuardClosedError(f"guard.check({name!r}): this guard was closed; create a new one"
                                   " with nanguard.init()")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"guard.check({name!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"guard.check: name must be a non-empty string, got {name!r}")
        if not self.settings.disable:
            self._detector.check(tensor, name)

    def begin_micro_batch(self, batch: Any) -> None:
        """A micro-batch begins with ``batch``, which the model's own forward does not take (a
        Lightning ``training_step`` calls submodules): it is captured with the step, and a replay
        puts the captured batch into it, in place."""
        root = next(iter(models_to_save(self._roots)), (None, None))[1]
        if self._closed or self.settings.disable or root is None:
            return
        self._observer.batch_given(root, batch)
        self._detector.root_pre(self._detector.slot_of(root), (batch,), {})

    def state_dict(self) -> dict[str, Any]:
        """The step count, skipped steps and the gradient-norm monitor's level, for a checkpoint."""
        return resume.state_dict(self._clock, self._respond)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's ``state_dict()`` (or a trainer's {"step": global_step}). A replay
        keeps its incident's step: the resumed script that made it loads its checkpoint again."""
        resume.load_state_dict(state, self._clock, self._respond, keep_step=self._observer.step is not None)

    def close(self, clean: bool | None = None) -> None:
        """Remove every hook this guard installed. Idempotent. ``clean=False``: the process ends by an error, and
        the coordinator counts this rank failed, not finished; by default, an error on its way out (outcome.py)."""
        if self._closed:
            return
        log = self._detector.log
        if log.started and not log.trained and log.values:  # a last evaluation, after the last step
            self._decider.settle_early("evaluation")
        self._closed = True
        self._finalizer.detach()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for undo in self._undo:
            undo()
        self._undo.clear()
        self._detector.detach()
        self._reporter.close(outcome.closing_cleanly() if clean is None else clean)
        REGISTRY.release(self)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: type | None, error: BaseException | None, traceback: Any) -> None:
        self.close(clean=outcome.clean(error, stops=False))

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("disabled" if self.settings.disable else "open")
        return f"<nanguard.Guard {state} step={self._clock.step} on_nan={self.settings.on_nan}>"

    # ------------------------------------------------------------------ installing
    def _attach(self, root: nn.Module) -> int:
        REGISTRY.claim(self, root)
        prefix = _prefix(self._roots, root)
        self._roots.append((_held(root), prefix))
        slot = self._detector.attach(root, prefix)
        if next(root.parameters(), None) is not None:
            self._observer.model_attached(root, self._detector.catalog.param_names, prefix)
        return slot

    def _discover(self, module: nn.Module, args: tuple) -> tuple | None:
        """Global pre-hook of a bare ``init()``: the first call of an unknown module is a root."""
        if torch.compiler.is_compiling() or self._detector.owns(module) or REGISTRY.owner(module):
            return None
        if isinstance(module, torch.fx.GraphModule):
            return None  # compiled code runs its graphs as modules; a user's FX model needs init(model)
        self._attach(module)
        if self._detector.depth:
            return None  # found inside another root's forward: a module of it there
        # Hooks added during this call's pre-hooks only fire from the next call on.
        fed = self._observer.first_call(module, args)
        self._detector.root_pre(self._detector.slot_of(module), fed or args, {}, module)
        return fed

    # ------------------------------------------------------------------ the steps
    def _on_step_start(self) -> None:
        # torch's RNG as it was when the step began, for the capture: small copies (a few us).
        # python's and numpy's are read at the capture instead (incident/rng.py says why).
        self._rng = None if self._detector.verdict else rng_snapshot(host=False)  # (see ``_step_rng``)

    def _on_root_end(self) -> None:
        if not self._clock.optimizer_seen and (self._scoped or not torch.is_grad_enabled()):
            self._decider.decide(None, collective=False)  # eval/inference: nothing steps, so decide now
        elif self._detector.pending >= self.settings.max_pending:
            log = self._detector.log
            self._decider.settle_early("evaluation" if log.started and not log.trained else None)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict):
        if self._closed:
            return None
        wrapped = closure_step(optimizer, args, kwargs,
                               lambda first, rewind: self._step_decision(optimizer, first, rewind), self._several)
        if wrapped is not None:
            return wrapped  # the forward and backward run inside the step: decide after them
        self._step_decision(optimizer)
        return None

    def _on_other_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._closed and not self._clock.optimizer_seen and self._clock.follow(optimizer):
            self._detector.new_step()

    def _step_decision(self, optimizer: torch.optim.Optimizer, count: bool = True, rewind: Rewind | None = None) -> None:
        self._observer.optimizers([optimizer], {})
        counted = self._clock.begin(optimizer, count)
        self._respond.rewind = rewind
        try:
            self._decider.decide(optimizer, collective=True)
        finally:
            self._clock.end(counted)
            self._respond.rewind = None

    def _after_scaler_update(self) -> None:
        # a step the scaler skipped was never decided, nor counted: it counts, and is decided from
        # the forward's checks (every rank's scaler skips the same steps: it reads summed gradients)
        stepped, self._clock.stepped = self._clock.stepped, False
        self._skipped_in_a_row = 0 if stepped else self._skipped_in_a_row + 1
        self._run_told = self._run_told and not stepped
        if stepped or self._closed:
            return
        if self._skipped_in_a_row >= 2 and not self._run_told:  # (the scale is read on a run of skips only)
            scale = float(self._respond.states["scaler"].get_scale())
            if scale < 1.0:  # gradients non-finite even scaled down: no overflow of the scale's making
                self._run_told = True
                self._respond.scaler_streak(self._skipped_in_a_row, scale, self._detector.backward.settle(),
                                            self._decider.event)
        counted = self._clock.skipped()
        try:
            if self._detector.pending:
                primary = self._clock.primary() if self._clock.primary is not None else None
                self._decider.decide(primary, collective=True, gradients_too=False)
        finally:
            self._clock.end(counted)
            self._clock.stepped = False

def _step_rng(taken: dict[str, Any] | None, log: StepLog) -> dict[str, Any] | None:
    """torch's RNG as the step began: taken then, or, where a bad step is re-run for the verdict, as its
    first micro-batch began (the same state: that one is kept for the microscope, and no second copy)."""
    return taken if taken is not None or not log.contexts else log.contexts[0].rng


def _held(root: nn.Module) -> Callable[[], nn.Module | None]:
    """A weak reference to ``root``; for a DDP root, one that gives the model it wraps once the
    script has let the wrapper go for a new one (to sync a module added later): what to save."""
    ref = weakref.ref(root)
    inner = ddp_inner(root)
    if inner is None:
        return ref
    inner_ref = weakref.ref(inner)
    return lambda: ref() if ref() is not None else inner_ref()


class GuardRegistry:
    """Which guard owns which module, and the process-wide guard of a bare ``init()``: hooks are
    never installed twice. The only mutable state at module level, behind its own lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owners: weakref.WeakKeyDictionary[nn.Module, Guard] = weakref.WeakKeyDictionary()
        self._modules: dict[int, list[weakref.ref]] = {}
        self._global: Guard | None = None
        self._generation = 0
        """moves at every claim and release"""

    def owner(self, module: nn.Module) -> Guard | None:
        return self._owners.get(module)

    def generation(self) -> int:
        return self._generation

    def all_elsewhere(self, guard: Guard, params: list[torch.Tensor]) -> bool:
        """Whether every one of ``params`` belongs to a model another open guard holds."""
        with self._lock:
            others = {id(g): g for g in self._owners.values() if g is not guard and not g.closed}.values()
        return bool(params) and bool(others) and all(
            any(g._detector.backward.watches(param) for g in others) for param in params)

    def claim(self, guard: Guard, root: nn.Module) -> None:
        with self._lock:
            for module in root.modules():
                owner = self._owners.get(module)
                if owner is not None and owner is not guard and not owner.closed:
                    raise NanguardError(
                        f"nanguard.init: {type(module).__name__} is already guarded by {owner!r};"
                        " call close() on that guard first (hooks are never installed twice)")
            for module in root.modules():
                self._owners[module] = guard
                self._modules.setdefault(id(guard), []).append(weakref.ref(module))
            self._generation += 1

    def check_process_free(self) -> None:
        with self._lock:
            if self._global is not None and not self._global.closed:
                raise NanguardError("nanguard.init(): a process-wide guard is already open; call"
                                    " close() on it first (hooks are never installed twice)")

    def claim_process(self, guard: Guard) -> None:
        self.check_process_free()
        with self._lock:
            self._global = guard

    def forget(self, guard_id: int) -> None:
        """A guard gone without ``close()``: the modules it claimed are gone before it."""
        with self._lock:
            self._modules.pop(guard_id, None)

    def release(self, guard: Guard) -> None:
        with self._lock:
            for ref in self._modules.pop(id(guard), []):
                module = ref()
                if module is not None and self._owners.get(module) is guard:
                    del self._owners[module]
            if self._global is guard:
                self._global = None
            self._generation += 1


REGISTRY = GuardRegistry()


def _prefix(roots: list[tuple[Callable[[], nn.Module | None], str]], root: nn.Module) -> str:
    """What a root's names begin with: nothing for the first root with parameters (the model's
    names are its own), its class name for any other a bare ``init()`` finds (a GAN's critic
    beside its generator, an EMA teacher beside its student, a loss module), with ``#k`` for
    the k-th root of that class (``Sequential#2``: the second ``Sequential``), so that no two
    modules share a name. ``roots``: those attached before, with their prefixes."""
    first = next(root.parameters(), None) is not None and not any(name == "" for _, name in roots)
    if first:
        return ""
    cls = type(root)
    k = 1 + sum(type(ref()) is cls for ref, _ in roots)
    taken = {name for _, name in roots}
    return next(name for n in range(k, k + len(taken) + 1)
                if (name := cls.__name__ if n == 1 else f"{cls.__name__}#{n}") not in taken)


_GONE: list[tuple[list[Any], list[Any], Reporter, int]] = []
"""(hook handles, registration handles, reporter, id) of guards gone without ``close()``, let go of
at the next ``init()``: a finalizer runs amid whatever the process is doing (an optimizer going
through torch's dict of step hooks, a thread holding the registry's lock, the reporter's own
thread), so it only appends here"""


def _let_go(handles: list[Any], registrations: list[Any], reporter: Reporter, guard_id: int) -> None:
    """A guard never closed is gone with every model and optimizer it guarded (a trial of a sweep,
    a notebook cell run again); its process-wide hooks, which hold it weakly, do nothing from now
    on, and go at the next ``init()`` (``_GONE``), with its link to the coordinator."""
    _GONE.append((handles, registrations, reporter, guard_id))


def forget_gone() -> None:
    """Let go of the guards gone without ``close()`` (``_GONE``): ``nanguard.init`` does it first."""
    while _GONE:
        handles, registrations, reporter, guard_id = _GONE.pop()
        for handle in [*handles, *registrations]:
            handle.remove()
        reporter.close(clean=True)  # (its training ended: nothing of it is left to step)
        REGISTRY.forget(guard_id)


def init_arguments(model: Any, optimizer: Any, on_stop: Any, scaler: Any,
                   scheduler: Any) -> tuple[list[torch.optim.Optimizer], dict[str, Any]]:
    """``nanguard.init``'s arguments checked: the optimizers to guard, and the states saved in
    incidents too (``scaler``, ``scheduler``); TypeError or NanguardError on those that cannot work."""
    optimizers = _checked_arguments(model, optimizer, on_stop)
    states = {name: obj for name, obj in (("scaler", scaler), ("scheduler", scheduler)) if obj is not None}
    for name, obj in states.items():
        if not callable(getattr(obj, "state_dict", None)):
            raise TypeError(f"nanguard.init: {name} must have a state_dict() method (a GradScaler,"
                            f" an LR scheduler); got {type(obj).__name__}")
    return optimizers, states


def start(model: nn.Module | None, optimizers: list[torch.optim.Optimizer], settings: Settings,
          on_stop: Callable[[Exception], Any] | None, states: dict[str, Any],
          observer: StepObserver | None) -> Guard:
    """The guard ``nanguard.init`` opens (``nanguard/api.py``, which chooses its observer): a disabled
    one, or one that holds its models (or, with none, the process) until it closes."""
    if settings.disable:
        _log.warning("nanguard: disabled (NANGUARD_DISABLE=1, or init(disable=True)): nothing in this process is"
                     " checked, and a non-finite value reaches the weights unseen")
        return Guard(None, [], settings, on_stop)
    # gloo's workers idle before Python finalizes, or one may abort the process (_dist.py says why)
    atexit.unregister(settle_gloo_workers)
    atexit.register(settle_gloo_workers)
    if model is None:
        REGISTRY.check_process_free()
    guard = Guard(model, optimizers, settings, on_stop, states, observer)
    if model is None:
        REGISTRY.claim_process(guard)
    # until it closes, an uncaught stop ends the rank with one line and torchrun's error file
    guard._undo.append(ending.hold())
    return guard


def _checked_arguments(model: Any, optimizer: Any, on_stop: Any) -> list[torch.optim.Optimizer]:
    """The optimizers to guard; TypeError or NanguardError on arguments that cannot work."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"nanguard.init: model must be a torch.nn.Module, or None to guard every"
                        f" module this process runs; got {type(model).__name__}")
    if optimizer is None:
        optimizers: list[torch.optim.Optimizer] = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizers = [optimizer]
    elif isinstance(optimizer, (list, tuple)) and all(
            isinstance(o, torch.optim.Optimizer) for o in optimizer) and optimizer:
        optimizers = list(optimizer)
    else:
        wrong = next((f"a {type(optimizer).__name__} whose item {k} is {type(o).__name__}" for k, o in enumerate(
            optimizer) if not isinstance(o, torch.optim.Optimizer)), "an empty " + type(optimizer).__name__) if \
            isinstance(optimizer, (list, tuple)) else type(optimizer).__name__
        raise TypeError(f"nanguard.init: optimizer must be a torch.optim.Optimizer (or a list of"
                        f" them, or None to find the optimizers that step the model); got {wrong}")
    optimizers = [unwrap_optimizer(o) for o in optimizers]
    if on_stop is not None and not callable(on_stop):
        raise TypeError(f"nanguard.init: on_stop must be callable, got {type(on_stop).__name__}")
    if model is not None and next(model.parameters(), None) is None:
        raise NanguardError(
            f"nanguard.init: the model ({type(model).__name__}) has no parameters, so there is"
            " nothing to protect; pass the module you train (or call nanguard.init() with no model)")
    if model is not None:
        mine = {id(p) for p in model.parameters()}
        for other in optimizers:
            if not any(id(p) in mine for group in other.param_groups for p in group["params"]):
                _log.warning("nanguard.init: the optimizer %s steps none of the parameters of the model given"
                            " (%s): its gradients are still checked at its steps, but named by shape only;"
                            " pass the model it trains", type(other).__name__, type(model).__name__)
    return optimizers
