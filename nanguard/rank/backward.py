"""What the backward pass is watched for: each DDP gradient bucket before its all-reduce (and each
FSDP2 reduce-scatter's input), and the parameters' gradients as the pass leaves them, before the
training loop clips, unscales or otherwise rewrites them (so that what it does to them cannot move
the blame). No host sync."""

from __future__ import annotations

import operator
import weakref
from collections import deque
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .._torch import foreach_norm, queue_callback
from .._torch.patches import before_first_comm_hook, route_comm_hooks, watch_reduce_scatters
from .._tree import floating_tensors
from . import forensics
from .records import StepLog, gradless, version_of

RECENT_STEPS = 16
"""the steps whose count of backward passes says how many the next will have at least"""


def probe(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(minimum, maximum) of a non-empty tensor: both finite exactly when every element is
    (no host sync)."""
    return torch.aminmax(forensics.plain(tensor))


class BackwardWatch:
    """Writes into ``log``: ``buckets`` (DDP) and ``produced`` (the gradients' norms at the end of
    each backward pass). ``attached()`` says whether the guard is still installed."""

    def __init__(self, log: StepLog, attached: Callable[[], bool], holds: Callable[[torch.Tensor], bool] | None = None):
        self.log = log
        self.attached = attached
        self.watches_buckets = False
        self.scaled = False
        """the gradients the backward pass leaves are scaled (a GradScaler's): their norms say which are
        finite, not how large they are"""
        self._by_id: dict[int, weakref.ref] = {}
        self._ddps: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        """the DDP wrappers whose buckets ``watch_ddp`` took on (once each)"""
        self._undo: list[Callable[[], None]] = []
        """what ``close`` runs: the undos of what watching changed in torch"""
        self._params: list[weakref.ref] = []
        """every parameter of the attached roots, frozen ones too (weakly: a guard keeps no model
        alive): one unfrozen later (gradual unfreezing) has its gradients read from then on"""
        self._queued = False
        self.passes = 0
        """backward passes that ended in this step so far"""
        self.expected = 1
        """the fewest backward passes (micro-batches) a recent step had: a pass before that many is not measured"""
        self._recent: deque[int] = deque(maxlen=RECENT_STEPS)
        self.armed = False
        """a forward output's node will say when the step's next backward pass starts"""
        self.holds = holds or (lambda tensor: False)
        """whether the gradient that will reach a root forward's output ``tensor`` is kept for the microscope
        (``StepLog.output_grads``), charged to the step's detail budget (``detector.Budget.holds``): never, by default"""

    def params(self) -> list[torch.Tensor]:
        """The parameters of the attached roots that are still alive."""
        return [p for ref in self._params if (p := ref()) is not None]

    def add_parameter(self, param: torch.Tensor) -> None:
        ref = weakref.ref(param)
        self._params.append(ref)
        self._by_id[id(param)] = ref

    def watches(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the attached roots' parameters (itself: not another tensor
        that took a freed one's id)."""
        ref = self._by_id.get(id(param))
        return ref is not None and ref() is param

    def watch_collectives(self, root: nn.Module, names: dict[nn.Module, str]) -> None:
        """Watch what sums the gradients across ranks in ``root`` (its modules by qualified name,
        itself among them): DDP's buckets, or FSDP2's reduce-scatters when the root is
        ``fully_shard``-ed (then every parameter is sharded, and each gradient goes through one)."""
        for module in names:
            if type(module).__name__ == "DistributedDataParallel":
                self.watch_ddp(module)
        if hasattr(root, "set_custom_reduce_scatter"):
            self.watch_fsdp({m: name for m, name in names.items() if hasattr(m, "set_custom_reduce_scatter")})

    def watch_ddp(self, ddp: nn.Module) -> None:
        """Probe each DDP gradient bucket *before* its all-reduce, so that a rank can tell a
        NaN born in its own backward from one the all-reduce brought in from another rank.

        DDP takes one communication hook: ours does the default all-reduce, and a hook the
        user registers later is called by ours instead (it replaces the default).
        """
        if ddp in self._ddps:
            return
        self._ddps.add(ddp)
        buckets = self.log.buckets

        def on_bucket(buffer: torch.Tensor) -> None:
            if self.attached() and buffer.numel():
                buckets.extend(probe(buffer))
                # queued after DDP's own end-of-backward work: the gradients are all-reduced by then
                self._queue_end()

        if route_comm_hooks(ddp, on_bucket):
            self.watches_buckets = True
        # (else the user registered a hook first: no per-rank origin for backward NaNs)

    def watch_new_ddp(self, ddp: nn.Module) -> None:
        """``ddp`` is being built around a guarded model, and is watched at its first forward (its
        reducer is not made yet). A communication hook registered on it before then (fp16
        compression, right after it is built) would leave its buckets unwatched: its registration
        makes ours first, then routes through it."""
        if ddp in self._ddps:
            return
        ref = weakref.ref(ddp)
        self._undo.append(before_first_comm_hook(ddp, lambda: self.watch_ddp(ref())))

    def watch_fsdp(self, modules: dict[nn.Module, str]) -> None:
        """Probe each FSDP2 reduce-scatter's input (this rank's own gradients of one
        ``fully_shard``-ed module, before they are summed across ranks), as DDP's buckets are,
        with the module's name: ``modules`` are every such module of a model whose root is one,
        by name. With the default reduce-scatter only; a model where any of them has another (its
        own, or several parameter groups) is not watched at all, and its reports say so."""
        log = self.log

        def on_input(name: str, tensor: torch.Tensor) -> None:
            if self.attached() and tensor.numel():
                log.buckets.extend(probe(tensor))
                log.bucket_groups.append(name)
                self._queue_end()

        undo = watch_reduce_scatters(modules, on_input)
        if undo is not None:
            self._undo.append(undo)
            self.watches_buckets = True

    def close(self) -> None:
        """Undo what watching changed in torch (``_torch.patches``), but DDP's hook: see ``route_comm_hooks``."""
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            step()

    @property
    def ddp(self) -> bool:
        """Whether a DDP's buckets are watched (its ranks hold the same weights)."""
        return bool(self._ddps)

    def watched(self) -> bool:
        """Whether this step's own gradients were seen before they were summed across ranks: not
        when nothing was probed there (one rank: FSDP2 sums nothing; a reduce-scatter that a
        later setting replaced), which cannot tell a rank's own NaN from another's."""
        return self.watches_buckets and bool(self.log.buckets)

    def forward_done(self, output: object, floating: list[torch.Tensor] | None = None) -> None:
        """A root forward returned ``output`` (or, where the script calls a model's modules itself,
        the step's first module did): its backward pass will be watched (where DDP's buckets are
        not, it says when the pass starts), and whether it runs at all (``StepLog.unpropagated``).
        ``floating``: its floating tensors, where the caller has them."""
        if torch.is_grad_enabled():
            # the gradient reaching the model's output comes first in its backward pass
            if type(output) is torch.Tensor:
                tensor, at = output, 0
            else:
                at, tensor = next(((k, t) for k, t in enumerate(
                    floating_tensors(output) if floating is None else floating) if t.requires_grad), (0, None))
            node = tensor.grad_fn if tensor is not None else None
            if node is not None or (tensor is not None and tensor.requires_grad):
                log, forward, timed = self.log, len(self.log.spans) - 1, not self.watches_buckets
                log.unpropagated.add(forward)
                keep = self.holds(tensor)
                slot = tensor.output_nr if node is not None else 0

                def started(grad: object) -> None:
                    log.unpropagated.discard(forward)
                    if keep:  # a reference, read on a bad step only
                        kept = grad if type(grad) is not tuple else grad[slot] if slot < len(grad) else None
                        if kept is not None and not forensics.transformed(kept):  # (torch.func's: not past it)
                            log.output_grads[forward] = (at, kept)
                    if timed:
                        self._started(grad)

                if node is not None:
                    node.register_prehook(started)  # cheaper than a hook on the tensor
                else:
                    tensor.register_hook(started)  # a leaf: it has no node
                self.armed = True

    def _started(self, grad: object) -> None:
        self.armed = False
        self._queue_end()

    def _queue_end(self) -> None:
        if not self._queued:
            try:
                queue_callback(self._ended)
            except RuntimeError:  # (none in this torch: the decision measures them as they are then)
                return
            self._queued = True

    def _ended(self) -> None:
        """The backward pass is over: the gradients as it left them, their norms from one fused
        pass (device tensors: nothing is read here)."""
        self._queued = False
        if not self.attached():
            return
        log = self.log
        if log.buckets and (not log.bucket_passes or log.bucket_passes[-1] < len(log.buckets)):
            log.bucket_passes.append(len(log.buckets))
        self.passes += 1
        owners = [p for ref in self._params if (p := ref()) is not None and p.grad is not None]
        grads = [p.grad for p in owners]
        # another pass will follow before the step's decision, as in every recent step (accumulation):
        # it measures what this one left summed with its own (a non-finite value stays non-finite),
        # so this one's norms are put off; should none follow, ``settle`` measures them then
        norms = None if self.passes < self.expected else _norms(grads)
        # a pass that left no gradient is none (torch.autograd.grad's: the script assigns what it
        # returned to .grad itself, as functional training does; they are read as the step takes them)
        log.produced = (owners, norms) if owners else None
        log.left = (owners, grads, _versions(grads))

    def settle(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Before the step's decision: the last pass's norms where they were put off (the step had
        fewer micro-batches than any recent one), measured now if its gradients are as it left them;
        else they are not known (``StepLog.unmeasured``: the decision measures them as they are, and
        a report says where they were made non-finite is not known). Returns ``StepLog.produced``."""
        log = self.log
        if log.produced is not None and log.produced[1] is None:
            owners = log.produced[0]
            log.unmeasured = not as_left(owners, log.left)
            log.produced = None if log.unmeasured else (owners, gradient_norms(owners)[1])
        return log.produced

    def step_decided(self) -> None:
        """The step is decided: its backward passes count among the recent steps' (a step with none does not)."""
        if self.passes:
            self._recent.append(self.passes)
            self.expected, self.passes = min(self._recent), 0


def keep_summed(watch: BackwardWatch) -> None:
    """A forward begins after a backward pass whose gradients were summed across ranks, in the same
    step (accumulation without ``no_sync``): the gradients as that sum left them (its communication
    hook's work is done by now, as it may not be when the pass ends) go into ``StepLog.summed_after``."""
    log = watch.log
    if len(log.summed_after) < len(log.bucket_passes):
        norms = gradient_norms(watch.params())[1]
        if norms:
            log.summed_after.append(gradless(torch.stack, norms).amax())


def _versions(grads: list[torch.Tensor]) -> list[int]:
    try:  # (no Python call per gradient: this runs on every step)
        return [g._version for g in grads]
    except RuntimeError:  # an inference tensor among them keeps no version
        return [version_of(g) for g in grads]


def as_left(owners: list[torch.Tensor], left: tuple[list, list, list[int]] | None) -> bool:
    """Whether every gradient of ``owners`` is as the backward pass left it (``StepLog.left``)."""
    if left is None:
        return False
    then, grads, versions = left
    if owners is not then:  # some of them (a GradScaler's optimizer's)
        at = {id(p): k for k, p in enumerate(then)}
        if not all(id(p) in at for p in owners):
            return False
        grads, versions = [grads[at[id(p)]] for p in owners], [versions[at[id(p)]] for p in owners]
    now = [p.grad for p in owners]
    return all(map(operator.is_, now, grads)) and _versions(now) == versions


def gradient_norms(params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters that have a gradient, their gradients' L2 norms from one fused pass). A norm
    is non-finite when a gradient element is, or when it overflows on finite values (the diagnosis
    confirms exactly). No host sync."""
    owners = [param for param in params if param.grad is not None]
    return owners, _norms([param.grad for param in owners])


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norms of ``grads`` (parameters' gradients) from one fused pass (no host sync)."""
    if not grads:
        return []
    # the common gradients, plain dense tensors, as they are: one check of each type, where
    # reading a tensor's layout and requires_grad costs ~0.3 us a gradient; a kind the fused
    # norm does not take (sparse) raises, and goes the general way
    if set(map(type, grads)) == {torch.Tensor}:
        try:  # (autograd off: a gradient made with create_graph has a graph, not followed)
            return list(gradless(foreach_norm, grads))
        except RuntimeError:
            pass
    return list(foreach_norm([forensics.plain(g.coalesce().values() if g.is_sparse else g) for g in grads]))
