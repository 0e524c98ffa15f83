"""Guard: ties the detector to the optimizer step and takes the cross-rank decision.

Once per optimizer step, in the optimizer's step pre-hook, the guard folds every probe of
the step and the gradients' norm into one small device vector, all-reduces its flag part
when ``torch.distributed`` is initialised (so every rank decides the same thing), and reads
it to the host: the only device-to-host read of a clean step. Only when that read says
something is non-finite does it look closer, exactly, and agree with the other ranks on
the job's first event before it acts.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import forensics
from . import incident as capture
from ._dist import Collectives, settle_gloo_workers
from .config import Settings
from .detector import Detector, grad_norms, gradients, stack
from .errors import ConfigError, GuardClosedError, NanguardError, NonFiniteError, StopRequested
from .events import Event, EventLog
from .protocol import FIRST_EVENT_ORDER
from .replay import Replay
from . import __version__

log = logging.getLogger("nanguard")


_owners: weakref.WeakKeyDictionary[nn.Module, Guard] = weakref.WeakKeyDictionary()
_global_guard: Guard | None = None
_registry_lock = threading.Lock()


def _distributed():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist
    return None


def _rank() -> int:
    dist = _distributed()
    if dist is not None:
        return dist.get_rank()
    return _env_int("RANK", 0)


def _world_size() -> int:
    """The job's world size; before ``init_process_group``, what torchrun says it will be."""
    dist = _distributed()
    return dist.get_world_size() if dist is not None else _env_int("WORLD_SIZE", 1)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _collective_device(dist) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Guard:
    """The per-process detector for one model (or, from a bare ``init()``, every model)."""

    def __init__(self, model: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer],
                 settings: Settings, on_stop: Callable[[Exception], Any] | None = None,
                 states: dict[str, Any] | None = None, replay: Replay | None = None):
        self.settings = settings
        self.incident: str | None = None
        """the last captured incident directory, or None"""
        self.last_grad_norm: float | None = None
        """the total gradient norm read at the last step (rank-local)"""
        self.last_param_grad_norms: dict[str, float] = {}
        """per-parameter gradient norms of the last clean step, with ``param_grad_norms=True``"""
        self.skipped_steps = 0
        self._step = 0
        self._index = 0  # the 0-based step that events happen in
        self._primary: weakref.ref | None = None
        self._events = EventLog(settings.max_events)
        self._on_stop = on_stop
        self._closed = False
        self._scoped = model is not None
        self._optimizer_seen = bool(optimizers)
        self._handles: list[Any] = []
        self._restore: list[Callable[[], Any]] = []  # undoes what is not a hook handle
        self._modules: list[weakref.ref] = []
        self._early: Event | None = None
        self._level: float | None = None
        self._clean_steps = 0
        self._stop_request: str | None = None  # set by the client's thread on a stop command
        self._stop_origin = "policy"
        self._client: Any = None
        self._last_decision: float | None = None
        self._stepped = False  # an optimizer step was decided since the scaler's last update()
        self._host = socket.gethostname()
        self._states = dict(states or {})  # name -> object with state_dict(): scaler, scheduler
        self._roots: list[weakref.ref] = []
        self._rng: dict[str, Any] | None = None
        self._replay = replay
        self._detector = Detector(skip_types=settings.skip_types, skip_modules=settings.skip_modules,
                                  detail_bytes=int(settings.detail_mb * 2**20),
                                  on_root_end=self._on_root_end,
                                  on_step_start=self._on_step_start if settings.capture is not False
                                  else None,
                                  keep_batches=settings.capture is not False and settings.capture_batch)
        if settings.disable:
            return
        if replay is not None:
            self._step = self._index = replay.incident.step
            # the original step was decided at an optimizer step, not at the end of a forward
            self._optimizer_seen = self._optimizer_seen or replay.stepped
            replay.load_optimizers(optimizers, self._states)
        if settings.coordinator is not None and replay is None:
            self._connect(settings)
        if "scaler" in self._states:
            self._watch_scaler(self._states["scaler"])
        if model is not None:
            self._attach(model)
        else:
            self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._discover))
        if optimizers:
            for optimizer in optimizers:
                self._handles.append(optimizer.register_step_pre_hook(self._on_step))
        else:
            self._handles.append(register_optimizer_step_pre_hook(self._on_step))

    # ------------------------------------------------------------------ public surface
    @property
    def step(self) -> int:
        """Optimizer steps seen, a refused one included (with several optimizers, the steps of
        the first one to step); between steps, the 0-based index of the next step. Events carry
        the index of the step they happened in."""
        return self._step

    @property
    def events(self) -> list[Event]:
        """The most recent events, oldest first (at most ``max_events``)."""
        return self._events.snapshot()

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

    def close(self) -> None:
        """Remove every hook this guard installed. Idempotent."""
        global _global_guard
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for undo in self._restore:
            undo()
        self._restore.clear()
        self._detector.detach()
        if self._client is not None:
            atexit.unregister(self._disconnect)
            self._disconnect()
        with _registry_lock:
            for ref in self._modules:
                module = ref()
                if module is not None and _owners.get(module) is self:
                    del _owners[module]
            if _global_guard is self:
                _global_guard = None

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("disabled" if self.settings.disable else "open")
        return f"<nanguard.Guard {state} step={self._step} on_nan={self.settings.on_nan}>"

    # ------------------------------------------------------------------ the coordinator
    def _connect(self, settings: Settings) -> None:
        """Report to the coordinator from a background thread; never blocks, never fails init."""
        from .client import Client  # pyzmq only where a coordinator is configured

        local_rank = _env_int("LOCAL_RANK", 0)
        identity = {
            "rank": _rank(), "local_rank": local_rank, "world_size": _world_size(),
            "host": self._host, "pid": os.getpid(),
            "job": os.environ.get("TORCHELASTIC_RUN_ID") or "local",
            "device": f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu",
            "version": __version__,
        }
        self._client = Client(settings.coordinator, token=settings.token, identity=identity,
                              queue_size=settings.event_queue, heartbeat_s=settings.heartbeat_s,
                              on_stop=self._remote_stop)
        self._client.start()
        # a script that ends with an exception still sends what is queued (its stop, its events)
        atexit.register(self._disconnect)

    def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close(timeout_s=2.0)

    def _remote_stop(self, command_id: str, reason: str, origin: str) -> None:
        # called on the client's thread: only plain assignments, read at the next decision
        self._stop_origin = origin
        self._stop_request = reason

    def _note(self, event: Event, action: str) -> None:
        """Keep an event; send it to the coordinator when this rank is the one that saw it."""
        self._events.add(event)
        client = self._client
        # values another rank sent through the all-reduce are that rank's event, not this one's
        if client is not None and event.rank == _rank() and event.extra.get("born_here", True):
            client.send_event(event, action)

    def _heartbeat(self) -> None:
        client = self._client
        if client is not None:
            now = time.monotonic()
            last, self._last_decision = self._last_decision, now
            client.update(self._index, now - last if last is not None else None, self.last_grad_norm)

    def _watch_scaler(self, scaler: Any) -> None:
        """A step that the GradScaler skips never calls ``optimizer.step()``, so the step
        pre-hook never decides it; the scaler's ``update()`` then decides it from the forward's
        checks. Gradients are left out there: scaled gradients that overflow are what the
        scaler handles itself, by skipping the step and lowering its scale."""
        update = scaler.update

        def guarded_update(*args, **kwargs):
            result = update(*args, **kwargs)
            stepped, self._stepped = self._stepped, False
            if not stepped and not self._closed and self._detector.pending:
                primary = self._primary() if self._primary is not None else None
                self._decide(primary, collective=True, gradients_too=False)
            return result

        scaler.update = guarded_update
        self._restore.append(lambda: scaler.__dict__.pop("update", None))

    # ------------------------------------------------------------------ installing
    def _attach(self, root: nn.Module, prefix: str = "") -> int:
        with _registry_lock:
            for module in root.modules():
                owner = _owners.get(module)
                if owner is not None and owner is not self and not owner.closed:
                    raise NanguardError(
                        f"nanguard.init: {type(module).__name__} is already guarded by {owner!r};"
                        " call close() on that guard first (hooks are never installed twice)")
            for module in root.modules():
                _owners[module] = self
                self._modules.append(weakref.ref(module))
        self._roots.append(weakref.ref(root))
        slot = self._detector.attach(root, prefix)
        if self._replay is not None and next(root.parameters(), None) is not None:
            self._replay.load_model(root, _unwrap(root), self._detector.param_names)
        return slot

    def _discover(self, module: nn.Module, args: tuple) -> tuple | None:
        """Global pre-hook of a bare ``init()``: the first call of an unknown module is a root."""
        if torch.compiler.is_compiling() or self._detector.owns(module) or module in _owners:
            return None
        if isinstance(module, torch.fx.GraphModule):
            return None  # compiled code runs its graphs as modules; a user's FX model needs init(model)
        self._attach(module)
        # Hooks added during this call's pre-hooks only fire from the next call on.
        fed = self._replay.first_call(module, args) if self._replay is not None else None
        self._detector.root_pre(self._detector.slot_of(module), fed or args, {})
        return fed

    # ------------------------------------------------------------------ decisions
    def _on_step_start(self) -> None:
        # The RNG as it was when the step began, for the capture: small host copies (about
        # 20 us). numpy's state is read at the capture instead (it costs 80 us to read, and the
        # forward, backward and optimizer step of a training loop do not draw from it).
        self._rng = capture.rng_snapshot(numpy=False)

    def _on_root_end(self) -> None:
        if not self._optimizer_seen and (self._scoped or not torch.is_grad_enabled()):
            self._decide(None, collective=False)  # eval/inference: nothing steps, so decide now
        elif self._detector.pending >= self.settings.max_pending:
            self._settle_early()

    def _on_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict):
        if self._closed:
            return None
        # args holds the optimizer itself first, then step()'s own arguments
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):
            # optimizer.step(closure) (Lightning, LBFGS) runs the forward and backward inside
            # the step, after this hook: decide once the closure has run, before the update.
            first = True  # LBFGS calls the closure several times in one step: count it once

            def guarded_closure():
                nonlocal first
                loss = closure()
                count, first = first, False
                self._step_decision(optimizer, count=count)
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": guarded_closure}
            return (args[0], guarded_closure, *args[2:]), kwargs
        self._step_decision(optimizer)
        return None

    def _step_decision(self, optimizer: torch.optim.Optimizer, count: bool = True) -> None:
        self._optimizer_seen = True
        self._stepped = True
        if self._replay is not None:
            self._replay.load_optimizers([optimizer], {})
        if self._primary is None:
            self._primary = weakref.ref(optimizer)
        primary = self._primary() is optimizer and count
        # With several optimizers, the first one to step counts the steps; another one stepping
        # after it in the same iteration (its probes already read) belongs to that same step.
        self._index = self._step if primary or self._detector.pending else max(self._step - 1, 0)
        try:
            self._decide(optimizer, collective=True)
        finally:
            self._step += primary
            self._index = self._step

    def _settle_early(self) -> None:
        """Too many probes without a step (a long eval loop): read them now, locally."""
        probes = self._detector.probes
        if probes and self._early is None:
            values = stack(probes).tolist()
            if not math.isfinite(sum(values)):
                fields = self._detector.first_bad(values)
                if fields is not None:
                    self._early = self._event(fields)
        self._detector.reset()
        if self._early is not None and not self._optimizer_seen:
            self._act(self._take_early(), None, collective=False)

    def _take_early(self) -> Event:
        event, self._early = self._early, None
        return event

    def _decide(self, optimizer: torch.optim.Optimizer | None, collective: bool,
                gradients_too: bool = True) -> None:
        dist = _distributed() if collective else None
        probes = self._detector.probes
        buckets = self._detector.bucket_probes if gradients_too else []
        owners, grads = (gradients(_params(optimizer)) if optimizer is not None and gradients_too
                         else ([], []))
        norms = grad_norms(grads) if grads else []
        parts = probes + norms + buckets
        if not parts and dist is None:
            self._detector.reset()
            if self._early is not None:
                self._act(self._take_early(), optimizer, collective=False)
            self._clean(stop=self._stop_request is not None)
            return
        local_stop = self._stop_request is not None
        if parts:
            vector = stack(parts)
        else:
            vector = torch.zeros(0, device=_collective_device(dist))
        if dist is not None:
            # every rank must take the same decision: share "something is bad" and "stop"
            flags = torch.stack([vector.sum() + (math.nan if self._early else 0.0),
                                 torch.full((), float(local_stop), device=vector.device)])
            dist.all_reduce(flags)
            vector = torch.cat([flags, vector])
        values = vector.tolist()  # the one device-to-host read of the step
        if dist is not None:
            (flag, stop), values = values[:2], values[2:]
            bad = not math.isfinite(flag)
        else:
            stop = local_stop
            bad = self._early is not None or not math.isfinite(sum(values))
        probe_values = values[:len(probes)]
        norm_values = values[len(probes):len(probes) + len(norms)]
        local_grads_bad = not math.isfinite(sum(values[len(probes) + len(norms):]))
        if bad:
            event = self._job_first_event(probe_values, owners, grads, dist, local_grads_bad)
            if event is not None:
                try:
                    # the step's batches are still held for the capture
                    self._act(event, optimizer, collective=dist is not None)
                finally:
                    self._detector.reset()
                return
        self._detector.reset()
        self._clean(stop)
        if norm_values:
            self._watch_norms(norm_values, owners)

    def _clean(self, stop: bool) -> None:
        """After a step found clean: a replay ends here, the coordinator hears of the step, and
        a requested stop is raised."""
        if self._replay is not None:
            self._replay.finish(None)
        self._heartbeat()
        if stop:
            self._stop()

    def _job_first_event(self, probe_values, owners, grads, dist, local_grads_bad) -> Event | None:
        local = (self._take_early() if self._early is not None
                 else self._local_first_event(probe_values, owners, grads))
        from_gradients = local is not None and "bad_params" in local.extra
        if from_gradients and self._detector.watches_buckets:
            local.extra["born_here"] = local_grads_bad
            if not local_grads_bad:
                local.kind = "grad"  # not this rank's loss: what the all-reduce brought in
                local.message += ("; this rank's own gradients were finite before DDP's"
                                  " all-reduce: another rank sent the non-finite values")
        if dist is None:
            return local
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local.to_dict() if local is not None else None)
        candidates = [Event.from_dict(d) for d in gathered if d is not None]
        if not candidates:
            return None
        first = min(candidates, key=lambda e: (
            FIRST_EVENT_ORDER.get(e.kind, 9), not e.extra.get("born_here", True), e.rank))
        if local is not None and first.rank != local.rank:
            self._note(local, self.settings.on_nan)  # what this rank saw, beside the job's first event
        return first

    def _local_first_event(self, probe_values, owners, grads) -> Event | None:
        fields = self._detector.first_bad(probe_values)
        if fields is not None:
            return self._event(fields)
        bad = [(p, g) for p, g in zip(owners, grads) if not forensics.is_finite(g)]
        if not bad:
            return None  # a norm that overflowed on finite gradients
        order = {slot: i for i, slot in enumerate(self._detector.backward_order())}
        owner_of = self._detector.param_owner
        bad.sort(key=lambda pg: order.get(owner_of.get(id(pg[0]), -1), len(order)))
        param, grad = bad[0]
        slot = owner_of.get(id(param))
        names = [self._param_name(p) for p, _ in bad]
        fields = {"kind": "grad", "layer": names[0],
                  "module_type": self._detector.slots[slot].module_type if slot is not None else "",
                  **forensics.describe(grad), "extra": {"bad_params": names[:16]}}
        counted = f"{len(bad)} of {len(grads)} parameter gradients are non-finite"
        last = next(iter(order), None)  # the last module to run: the first in backward order
        if last is not None and owner_of.get(id(param)) == last:
            # Even the first gradients of the backward pass are bad: what entered it was.
            return self._event(fields | {
                "kind": "loss", "layer": "loss", "module_type": "",
                "message": f"the forward was finite but {counted}, starting with {names[0]}, the"
                           " first in backward order: the gradient entering the model's backward"
                           " was already non-finite, so most likely the loss (or code between the model and"
                           " the loss) made it; guard.check(loss) shows the loss's value"})
        return self._event(fields | {"message": (
            f"{counted}, this one first in backward order; the forward and the gradients of the"
            " modules that ran after it were finite, so it was born in the backward pass")})

    def _event(self, fields: dict[str, Any]) -> Event:
        return Event(rank=_rank(), step=self._index, host=self._host, time=time.time(), **fields)

    def _act(self, event: Event, optimizer: torch.optim.Optimizer | None,
             collective: bool) -> None:
        """Apply the policy. ``collective``: every rank is here at the same step (so the capture
        may use collectives); a local decision of one rank of many writes no incident."""
        policy = self.settings.on_nan
        self._note(event, policy)
        if self._replay is not None:
            self._replay.finish(event)
        dist = _distributed() if collective else None
        world = dist.get_world_size() if dist is not None else 1
        action = {
            "raise": "stopping all ranks before the optimizer step" if world > 1
            else "stopping before the optimizer step",
            "skip": "skipping this update" + (" on all ranks" if world > 1 else ""),
            "warn": "continuing (on_nan=warn)",
        }[policy]
        if optimizer is None and policy != "warn":
            action = "stopping" if policy == "raise" else "continuing (no optimizer step to skip)"
        message = f"{event}; {action}"
        if event.rank == _rank():
            log.error("nanguard: %s", message)
        wanted = policy == "raise" and self.settings.capture is not False or (
            policy == "skip" and self.settings.capture)
        if wanted and (collective or _distributed() is None):
            self.incident = self._capture(event, optimizer)
            if self.incident is not None and event.rank == _rank():
                log.error("nanguard: state from before step %d saved to %s (nanguard inspect %s)",
                          event.step, self.incident, self.incident)
            if self.incident is not None and self._client is not None and _rank() == 0:
                self._client.captured(event.step, self.incident)
        if policy == "skip" and optimizer is not None:
            for param in _params(optimizer):
                param.grad = None  # the optimizer leaves parameters without gradients untouched
            self.skipped_steps += 1
        if policy == "raise":
            error = NonFiniteError(message, event, self.incident)
            if self._client is not None:
                self._client.stopped(event.step, "nonfinite")
            if self._on_stop is not None:
                self._on_stop(error)
            raise error

    def _capture(self, event: Event, optimizer: torch.optim.Optimizer | None) -> str | None:
        """Every rank writes its part of one incident folder; rank 0 writes the manifest last.

        A failed write is reported and leaves no complete-looking folder; it never stops the
        error from being raised.
        """
        model = self._model_to_save()

        def collect() -> capture.RankPart:
            batches = None
            if self.settings.capture_batch:
                root = self._detector.slot_of(model) if model is not None and self._detector.owns(
                    model) else None
                batches = [{"args": a, "kwargs": k} for slot, a, k in
                           self._detector.batches if root is None or slot == root]
            return capture.RankPart(
                model_state=_unwrap(model).state_dict() if model is not None else {},
                optimizer_state=optimizer.state_dict() if optimizer is not None else None,
                extra_states={name: obj.state_dict() for name, obj in self._states.items()},
                batches=batches,
                rng=self._rng_at_step_start(),
                events=self.events,
                settings=self._settings_record())

        return capture.capture_incident(Collectives(), self.settings.dir, event, collect,
                                        job_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                                        capture_batch=self.settings.capture_batch, sharded=_sharding(model))

    def _rng_at_step_start(self) -> dict[str, Any]:
        now = capture.rng_snapshot()
        return now if self._rng is None else {**self._rng, "numpy": now["numpy"]}

    def _model_to_save(self) -> nn.Module | None:
        roots = [r() for r in self._roots]
        return next((m for m in roots if m is not None and next(m.parameters(), None) is not None),
                    None)

    def _settings_record(self) -> dict[str, Any]:
        record = {}
        for name in self.settings.__dataclass_fields__:
            if name == "token":
                continue  # a secret never goes to disk
            value = getattr(self.settings, name)
            record[name] = [v if isinstance(v, str) else v.__name__ for v in value] if isinstance(
                value, tuple) else value
        return record

    def _stop(self) -> None:
        reason = self._stop_request or "requested by the coordinator through another rank"
        self._stop_request = None
        error = StopRequested(
            f"stop requested ({reason}) at step {self._index}; stopping all ranks before the"
            " optimizer step", step=self._index, reason=reason)
        if self._client is not None:
            self._client.stopped(self._index, self._stop_origin)
        if self._on_stop is not None:
            self._on_stop(error)
        raise error

    def _watch_norms(self, norms: list[float], owners: list[torch.Tensor]) -> None:
        """Grad-norm guard: warn on a threshold and on a spike over the running level."""
        settings = self.settings
        norm = math.hypot(*norms)
        self.last_grad_norm = norm
        if settings.param_grad_norms:
            self.last_param_grad_norms = {self._param_name(p): n for p, n in zip(owners, norms)}
        if not math.isfinite(norm):
            return  # finite gradients whose norm overflows: nothing to compare
        warnings = []
        if settings.grad_norm_warn is not None and norm > settings.grad_norm_warn:
            warnings.append(("grad_norm", f"gradient norm {norm:.4g} is above grad_norm_warn"
                                          f" {settings.grad_norm_warn:.4g}"))
        armed = self._clean_steps >= settings.spike_warmup_steps and self._level
        if armed and norm > settings.spike_factor * self._level:
            warnings.append(("spike", f"gradient norm {norm:.4g} is {norm / self._level:.1f}x its"
                                      f" running level {self._level:.4g}"))
        else:
            # running level: the mean over warm-up, then an exponential average of ordinary steps
            self._clean_steps += 1
            weight = max(1 / self._clean_steps, 0.05)
            self._level = norm if self._level is None else (1 - weight) * self._level + weight * norm
        if not warnings:
            return
        ranked = sorted(zip(norms, owners), key=lambda pair: -pair[0])[:5]
        top = {self._param_name(p): n for n, p in ranked}
        for kind, text in warnings:
            event = self._event({"kind": kind, "layer": next(iter(top), ""), "grad_norm": norm,
                                 "message": text, "extra": {"top_params": top}})
            self._note(event, "warn")
            log.warning("nanguard: %s", event)

    def _param_name(self, param: torch.Tensor) -> str:
        name = self._detector.param_names.get(id(param))
        return name if name is not None else f"<unnamed parameter of shape {list(param.shape)}>"


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel / torch.compile wrappers (plain state names)."""
    while type(model).__name__ in ("DistributedDataParallel", "DataParallel", "OptimizedModule"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def _sharding(model: nn.Module | None) -> str | None:
    if model is not None and any(hasattr(p, "to_local") for p in model.parameters()):
        return ("fsdp2: each rank's state.pt holds its own shards (DTensors); load rank k's file on"
                " rank k of a job with the same world size and the same fully_shard layout")
    return None


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


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
    global _global_guard
    settings = Settings.resolve(overrides)
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
        raise TypeError(f"nanguard.init: optimizer must be a torch.optim.Optimizer (or a list of"
                        f" them, or None); got {type(optimizer).__name__}")
    if on_stop is not None and not callable(on_stop):
        raise TypeError(f"nanguard.init: on_stop must be callable, got {type(on_stop).__name__}")
    states = {name: obj for name, obj in (("scaler", scaler), ("scheduler", scheduler))
              if obj is not None}
    for name, obj in states.items():
        if not callable(getattr(obj, "state_dict", None)):
            raise TypeError(f"nanguard.init: {name} must have a state_dict() method (a GradScaler,"
                            f" an LR scheduler); got {type(obj).__name__}")
    if model is not None and next(model.parameters(), None) is None:
        raise NanguardError(
            f"nanguard.init: the model ({type(model).__name__}) has no parameters, so there is"
            " nothing to protect; pass the module you train (or call nanguard.init() with no model)")
    replay = None
    if settings.replay is not None:
        if settings.disable:
            raise ConfigError("NANGUARD_REPLAY and NANGUARD_DISABLE are both set: a replay needs the"
                              " guard; unset one of them")
        # checks the whole incident before touching anything
        replay = Replay.open(settings.replay, _rank(), _world_size())
        settings = replay.forensic(settings)
    if settings.disable:
        return Guard(None, [], settings, on_stop)
    # gloo's workers idle before Python finalizes, or one may abort the process (_dist.py says why)
    atexit.unregister(settle_gloo_workers)
    atexit.register(settle_gloo_workers)
    if model is None:
        with _registry_lock:
            if _global_guard is not None and not _global_guard.closed:
                raise NanguardError("nanguard.init(): a process-wide guard is already open; call"
                                    " close() on it first (hooks are never installed twice)")
        guard = Guard(None, optimizers, settings, on_stop, states, replay)
        with _registry_lock:
            _global_guard = guard
        return guard
    return Guard(model, optimizers, settings, on_stop, states, replay)
