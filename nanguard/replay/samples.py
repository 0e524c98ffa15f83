"""Which samples of the captured batch make the step non-finite: the model run again on parts of
each micro-batch, split in halves along the batch dimension (bisection), within a cap of runs.

What a run checks: every module's output in the forward and, when the whole micro-batch was bad
only in backward, the parameters' gradients of a backward of ones into the model's outputs (the
script's loss is not nanguard's to run): into those of the root forward's outputs that received a
gradient in the replayed step's own backward (``UsedOutputs``), or into every output where that is
not known; a sample bad alone only in a backward into every output of several is not named bad
(the loss may never use the output that made it bad): it is a suspect. A sample is named bad only
when it was run alone and went bad. Runs leave the model, the optimizer and the RNG as they were
(``quiet``); each starts from the step's captured RNG state.

Bisection assumes that a part is bad when it holds a bad sample. A model that mixes samples
breaks that: BatchNorm in train mode normalises with the statistics of whatever batch it is
given, so a part's statistics differ from the batch's; dropout in train mode draws its masks
anew for each part's shape, so a part's masks are not the step's. The search says so when such
modules ran in its runs, and when a part was bad though neither of its halves was ("bad only
together").
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._tree import floating_tensors, map_tensors
from ..incident import rng_restore
from ..rank import forensics
from ..rank.modules import plain_names, untraced
from .quiet import quiet, restore_buffers, saved_buffers

MAX_RUNS = 64  # runs of the model per rank: 2 bad samples of 4096 take about 50
CLEAN, FORWARD, BACKWARD, CAPPED = "clean", "forward", "backward", "capped"
CHECKED = {False: "every module's output",
           True: "every module's output, and the parameters' gradients of a backward of ones into the"
                 " model's outputs (not the script's loss)"}
USED = ("every module's output, and the parameters' gradients of a backward of ones into the model's outputs"
        " that received a gradient in the step's backward ({outputs} of its {count} floating output(s); not the"
        " script's loss)")


def autocast_now() -> list[tuple[str, torch.dtype]]:
    """The autocast regions open here, as (device type, dtype): the sample search runs under the
    script's, since a value can overflow in float16 and not in float32."""
    return [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]


def batch_size(batch: Mapping[str, Any]) -> int | None:
    """The size of dimension 0 of the first tensor (with one) that the model is called with."""
    for tensor in _tensors((batch["args"], batch["kwargs"])):
        if tensor.dim() >= 1:
            return int(tensor.shape[0])
    return None


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t))
    return found


def part(batch: Mapping[str, Any], indices: list[int], size: int) -> dict[str, Any]:
    """The samples ``indices`` of a micro-batch: every tensor whose dimension 0 is ``size`` is
    indexed along it, the others (masks shared by all samples, scalars) are kept whole."""
    index = torch.tensor(indices, dtype=torch.long)

    def select(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() >= 1 and tensor.shape[0] == size:
            return tensor.index_select(0, index.to(tensor.device))
        return tensor

    return {"args": map_tensors(batch["args"], select), "kwargs": map_tensors(batch["kwargs"], select)}


def sample_ids(batch: Mapping[str, Any], key: str, size: int) -> tuple[list[Any] | None, str | None]:
    """The ids under ``key`` in what the model is called with (a key of a dict, a keyword, a
    field), one per sample; or None and why not."""
    value = _find(batch["kwargs"], key, 0)
    if value is _MISSING:
        value = _find(batch["args"], key, 0)
    if value is _MISSING:
        return None, (f"the captured batch has no {key!r} (sample_id_key): the ids must reach the model, as a"
                      " key of a dict or a keyword argument it is called with")
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == size:
        ids = value.tolist()
    elif isinstance(value, (list, tuple)) and len(value) == size:
        ids = list(value)
    else:
        return None, f"{key!r} in the captured batch does not hold one id per sample (of {size})"
    return [i if isinstance(i, (int, str)) and not isinstance(i, bool) else str(i) for i in ids], None


_MISSING = object()


def _find(obj: Any, key: str, depth: int) -> Any:
    if depth > 8:
        return _MISSING
    if isinstance(obj, Mapping):
        if key in obj:
            return obj[key]
        children = list(obj.values())
    elif hasattr(type(obj), "_fields") or hasattr(obj, "__dataclass_fields__"):
        if key in getattr(obj, "_fields", ()) or key in getattr(obj, "__dataclass_fields__", {}):
            return getattr(obj, key)
        children = list(obj) if isinstance(obj, tuple) else [getattr(obj, f) for f in obj.__dataclass_fields__]
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    else:
        return _MISSING
    for child in children:
        found = _find(child, key, depth + 1)
        if found is not _MISSING:
            return found
    return _MISSING


def mixing(names: Mapping[nn.Module, str]) -> list[str]:
    """Modules that make one sample's output depend on the others', or on the part's shape (random
    masks), of ``names`` (the modules called in the search's runs, by name: ``Runner.ran_names``)."""
    norms = [name for module, name in names.items()
             if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training]
    notes = []
    if norms:
        notes.append(f"{len(norms)} BatchNorm module(s) in train mode ({', '.join(norms[:3])}) normalise with the"
                     " statistics of the whole batch: one bad sample spoils every sample's output, and a part's"
                     " statistics are not the batch's, so a sample named here is bad with the statistics of the"
                     " parts it was run in")
    drawing = random_modules(names)
    if drawing:
        notes.append(f"{len(drawing)} module(s) that draw random numbers in train mode ({', '.join(drawing[:3])}):"
                     " every run starts from the step's RNG state, but the masks are drawn anew for each part's"
                     " shape, so a sample bad under the step's own masks may be found bad only together, or not at"
                     " all, and a sample named here is bad under the masks of the parts it was run in")
    return notes


def random_modules(names: Mapping[nn.Module, str]) -> list[str]:
    """The names of the modules of ``names`` that draw random numbers in their forward: dropout
    (any kind, p > 0) and RReLU in train mode."""
    return [name for module, name in names.items() if module.training and (
        (isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)
        or (isinstance(module, nn.RReLU) and module.lower != module.upper))]


class UsedOutputs:
    """A forward hook for the replayed step's root module: tensor hooks on the floating outputs
    (by index in ``floating_tensors``) of its first forward after ``arm()``, which note the ones
    that receive a gradient in the step's own backward (the script's loss's)."""

    def __init__(self) -> None:
        self.armed = False
        self.count = 0
        self.used: set[int] = set()

    def arm(self) -> None:
        self.armed = True

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.armed:
            return
        self.armed = False
        floats = floating_tensors(output)
        self.count = len(floats)
        for i, tensor in enumerate(floats):
            if tensor.requires_grad:
                tensor.register_hook(self._noted(i))

    def _noted(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            self.used.add(index)

        return hook

    def indices(self) -> list[int] | None:
        """The outputs that received a gradient, or None where none did (not known)."""
        return sorted(self.used) or None


class Runner:
    """Runs the model on one part of a micro-batch and says how it went; counts runs up to a cap."""

    def __init__(self, model: nn.Module, rng: Any, skipped: set[str], max_runs: int,
                 autocast: Sequence[tuple[str, torch.dtype]] = (), outputs: Sequence[int] | None = None):
        self.model = model
        self.rng = rng
        self.autocast = autocast
        self.modules = plain_names(model)
        self.names = {m: n for m, n in self.modules.items() if n not in skipped}
        self.max_runs = max_runs
        self.runs = 0
        self.capped = False
        self.ran: set[nn.Module] = set()
        """the modules called in the runs so far"""
        self.outputs = set(outputs) if outputs else None
        """the indices (in ``floating_tensors``) of the outputs a backward goes into; None: every one"""
        self.into_every = 0
        """backward runs that went into every output of several (the used ones not known or not found)"""
        self.output_count = 0
        """the most floating outputs a run's forward returned"""

    def ran_names(self) -> dict[nn.Module, str]:
        """The modules called in the runs so far, by name (the root's: "the model")."""
        return {m: n or "the model" for m, n in self.modules.items() if m in self.ran}

    def run(self, batch: Mapping[str, Any], backward: bool) -> str:
        """CLEAN, FORWARD (a module's output was non-finite), BACKWARD (a parameter's gradient),
        CAPPED (no run left), or the error the model raised on this part."""
        if self.runs >= self.max_runs:
            self.capped = True
            return CAPPED
        self.runs += 1
        rng_restore(self.rng)
        bad: list[str] = []
        handles = [m.register_forward_hook(_check(bad, self.ran, m in self.names)) for m in self.modules]
        buffers = saved_buffers(self.model)
        try:
            with torch.enable_grad(), contextlib.ExitStack() as regions:
                for device, dtype in self.autocast:
                    regions.enter_context(torch.autocast(device, dtype=dtype))
                out = self.model(*batch["args"], **batch["kwargs"])
                if bad or not all(forensics.is_finite(t) for t in floating_tensors(out)):
                    return FORWARD
                return BACKWARD if backward and self._bad_gradients(out) else CLEAN
        except Exception as exc:  # noqa: BLE001
            # The user's model, run on a part of a batch it was never given: whatever it raises
            # (BatchNorm on one sample, a shape check) is this part's answer, not a reason to lose
            # the replay's report.
            return f"{type(exc).__name__}: {exc}"
        finally:
            for handle in handles:
                handle.remove()
            restore_buffers(buffers)

    def _bad_gradients(self, out: Any) -> bool:
        floats = floating_tensors(out)
        self.output_count = max(self.output_count, len(floats))
        used = self.outputs
        if used is not None and (max(used) >= len(floats) or not any(floats[i].requires_grad for i in used)):
            used = None  # the step's outputs do not match this run's: every output, and said
        outputs = [t for i, t in enumerate(floats) if t.requires_grad and (used is None or i in used)]
        if used is None and len(outputs) > 1:
            self.into_every += 1
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not outputs or not params:
            return False
        # autograd.grad, not backward(): nothing is accumulated into the parameters' .grad
        grads = torch.autograd.grad(outputs, params, grad_outputs=[torch.ones_like(t) for t in outputs],
                                    allow_unused=True)
        return any(g is not None and not forensics.is_finite(g) for g in grads)


def _check(bad: list[str], ran: set[nn.Module], check: bool):
    def hook(module, args, output):
        ran.add(module)
        if check and not bad and not all(forensics.is_finite(t) for t in floating_tensors(output)):
            bad.append("bad")

    return untraced(hook)  # (a model compiled in place runs it inside its frame: reads are not traced)


def search(model: nn.Module, batches: list[Any], rng: Any, *, key: str | None, skipped: set[str],
           max_runs: int = MAX_RUNS, autocast: Sequence[tuple[str, torch.dtype]] = (),
           outputs: Sequence[int] | None = None) -> dict[str, Any]:
    """Each micro-batch run again whole, and a bad one split until its bad samples are found
    alone (or the cap of runs is reached); under ``autocast`` (``autocast_now()`` in the step).
    ``outputs``: the indices (in ``floating_tensors``) of the model's outputs that received a
    gradient in the step's backward (``UsedOutputs``), the only ones a run's backward goes into;
    None: not known, every output."""
    runner = Runner(model, rng, skipped, max_runs, autocast, outputs)
    with quiet(model):
        found = [_search_one(runner, k, batch, key) for k, batch in enumerate(batches)]
    return {"searched": True, "runs": runner.runs, "max_runs": max_runs, "capped": runner.capped,
            "micro_batches": found, "mixing": mixing(runner.ran_names()), "sample_id_key": key,
            "outputs": sorted(set(outputs)) if outputs else None,
            "autocast": [f"{device} {str(dtype).removeprefix('torch.')}" for device, dtype in autocast]}


def _search_one(runner: Runner, index: int, batch: Mapping[str, Any], key: str | None) -> dict[str, Any]:
    size = batch_size(batch)
    entry: dict[str, Any] = {"micro_batch": index, "size": size, "outcome": None, "checked": None, "bad": [],
                             "ids": None, "unresolved": [], "rest_clean": None, "note": None, "suspects": [],
                             "suspect_ids": None}
    if size is None:
        entry["note"] = "no tensor with a batch dimension in it: not searched"
        return entry
    outcome = entry["outcome"] = runner.run(batch, backward=True)
    if outcome not in (FORWARD, BACKWARD):
        if outcome not in (CLEAN, CAPPED):
            entry.update(outcome="error", note=f"the whole micro-batch did not run again: {outcome}")
        return entry
    backward = outcome == BACKWARD
    every_before = runner.into_every
    found, unresolved = _bisect(runner, batch, size, backward)
    into_every = runner.into_every > every_before
    if not backward:
        entry["checked"] = CHECKED[False]
    elif into_every or runner.outputs is None:
        entry["checked"] = CHECKED[True]
    else:
        entry["checked"] = USED.format(outputs="output(s) " + ", ".join(map(str, sorted(runner.outputs))),
                                       count=runner.output_count)
    # a sample bad alone only in a backward into every output of several: the step's loss may never
    # use the output that made it bad, so it is not named bad (nor written to the skip file)
    suspects = sorted(i for i, o in found.items() if o == BACKWARD and into_every)
    bad = sorted(i for i in found if i not in suspects)
    entry.update(bad=bad, unresolved=unresolved, suspects=suspects)
    if found and not unresolved and len(found) < size:
        rest = sorted(set(range(size)) - set(found))
        rest_outcome = runner.run(part(batch, rest, size), backward)
        entry["rest_clean"] = None if rest_outcome == CAPPED else rest_outcome == CLEAN
    if key is not None:
        ids, entry["note"] = sample_ids(batch, key, size)
        entry["ids"] = None if ids is None else [ids[i] for i in bad]
        entry["suspect_ids"] = None if ids is None or not suspects else [ids[i] for i in suspects]
    return entry


def _bisect(runner: Runner, batch: Mapping[str, Any], size: int, backward: bool
            ) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """Halves of bad parts, breadth first: the bad samples found alone (with how each went bad:
    FORWARD or BACKWARD), and the parts that could not be split further (with why)."""
    bad: dict[int, str] = {}
    unresolved: list[dict[str, Any]] = []
    queue = deque([(0, size, BACKWARD if backward else FORWARD)])
    while queue:
        lo, hi, how = queue.popleft()
        if hi - lo == 1:
            bad[lo] = how
            continue
        halves = [(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)]
        outcomes = [runner.run(part(batch, list(range(a, b)), size), backward) for a, b in halves]
        if CAPPED in outcomes:
            unresolved += [_group(a, b, f"not split further: the cap of {runner.max_runs} runs was reached")
                           for a, b, _ in [(lo, hi, how), *queue]]
            break
        failed = [(h, o) for h, o in zip(halves, outcomes) if o not in (CLEAN, FORWARD, BACKWARD)]
        if len(failed) == len(halves):
            failed = [((lo, hi), failed[0][1])]  # neither half runs alone: the part stays whole
        unresolved += [_group(a, b, f"could not run alone: {o}") for (a, b), o in failed]
        bad_halves = [(a, b, o) for (a, b), o in zip(halves, outcomes) if o in (FORWARD, BACKWARD)]
        if not bad_halves and not failed:
            drawing = random_modules(runner.ran_names())
            why = (f"{', '.join(drawing[:3])} in train mode draw(s) random masks anew for each part's shape, not"
                   " the step's own masks; or the model mixes samples, or the fault needs several"
                   " of them") if drawing else "the model mixes samples, or the fault needs several of them"
            unresolved.append(_group(lo, hi, f"bad only together: neither half alone is bad ({why})"))
        queue.extend(bad_halves)
    return dict(sorted(bad.items())), unresolved


def _group(start: int, stop: int, why: str) -> dict[str, Any]:
    return {"from": start, "to": stop, "why": why}
