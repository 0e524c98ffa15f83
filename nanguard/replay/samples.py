"""Which samples of the captured batch make the step non-finite: the model run again on parts of
each micro-batch, split in halves along the batch dimension (bisection), within a cap of runs.

What a run checks: every module's output in the forward and, when the whole micro-batch was bad
only in backward, the parameters' gradients of a backward of ones into the model's outputs (the
script's loss is not nanguard's to run). A sample is named bad only when it was run alone and
went bad. Runs leave the model, the optimizer and the RNG as they were (``quiet``); each starts
from the step's captured RNG state.

Bisection assumes that a part is bad when it holds a bad sample. A model that mixes samples
breaks that: BatchNorm in train mode normalises with the statistics of whatever batch it is
given, so a part's statistics differ from the batch's. The search says so when it finds such
modules, and when a part was bad though neither of its halves was ("bad only together").
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


def mixing(model: nn.Module) -> list[str]:
    """Modules that make one sample's output depend on the others'."""
    norms = [name or "<root>" for module, name in plain_names(model).items()
             if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training]
    if not norms:
        return []
    return [f"{len(norms)} BatchNorm module(s) in train mode ({', '.join(norms[:3])}) normalise with the"
            " statistics of the whole batch: one bad sample spoils every sample's output, and a part's"
            " statistics are not the batch's, so a sample named here is bad with the statistics of the parts"
            " it was run in"]


class Runner:
    """Runs the model on one part of a micro-batch and says how it went; counts runs up to a cap."""

    def __init__(self, model: nn.Module, rng: Any, skipped: set[str], max_runs: int,
                 autocast: Sequence[tuple[str, torch.dtype]] = ()):
        self.model = model
        self.rng = rng
        self.autocast = autocast
        self.names = {m: n for m, n in plain_names(model).items() if n not in skipped}
        self.max_runs = max_runs
        self.runs = 0
        self.capped = False

    def run(self, batch: Mapping[str, Any], backward: bool) -> str:
        """CLEAN, FORWARD (a module's output was non-finite), BACKWARD (a parameter's gradient),
        CAPPED (no run left), or the error the model raised on this part."""
        if self.runs >= self.max_runs:
            self.capped = True
            return CAPPED
        self.runs += 1
        rng_restore(self.rng)
        bad: list[str] = []
        handles = [m.register_forward_hook(_check(bad)) for m in self.names]
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
        outputs = [t for t in floating_tensors(out) if t.requires_grad]
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not outputs or not params:
            return False
        # autograd.grad, not backward(): nothing is accumulated into the parameters' .grad
        grads = torch.autograd.grad(outputs, params, grad_outputs=[torch.ones_like(t) for t in outputs],
                                    allow_unused=True)
        return any(g is not None and not forensics.is_finite(g) for g in grads)


def _check(bad: list[str]):
    def hook(module, args, output):
        if not bad and not all(forensics.is_finite(t) for t in floating_tensors(output)):
            bad.append("bad")

    return untraced(hook)  # (a model compiled in place runs it inside its frame: reads are not traced)


def search(model: nn.Module, batches: list[Any], rng: Any, *, key: str | None, skipped: set[str],
           max_runs: int = MAX_RUNS, autocast: Sequence[tuple[str, torch.dtype]] = ()) -> dict[str, Any]:
    """Each micro-batch run again whole, and a bad one split until its bad samples are found
    alone (or the cap of runs is reached); under ``autocast`` (``autocast_now()`` in the step)."""
    runner = Runner(model, rng, skipped, max_runs, autocast)
    with quiet(model):
        found = [_search_one(runner, k, batch, key) for k, batch in enumerate(batches)]
    return {"searched": True, "runs": runner.runs, "max_runs": max_runs, "capped": runner.capped,
            "micro_batches": found, "mixing": mixing(model), "sample_id_key": key,
            "autocast": [f"{device} {str(dtype).removeprefix('torch.')}" for device, dtype in autocast]}


def _search_one(runner: Runner, index: int, batch: Mapping[str, Any], key: str | None) -> dict[str, Any]:
    size = batch_size(batch)
    entry: dict[str, Any] = {"micro_batch": index, "size": size, "outcome": None, "checked": None, "bad": [],
                             "ids": None, "unresolved": [], "rest_clean": None, "note": None}
    if size is None:
        entry["note"] = "no tensor with a batch dimension in it: not searched"
        return entry
    outcome = entry["outcome"] = runner.run(batch, backward=True)
    if outcome not in (FORWARD, BACKWARD):
        if outcome not in (CLEAN, CAPPED):
            entry.update(outcome="error", note=f"the whole micro-batch did not run again: {outcome}")
        return entry
    backward = outcome == BACKWARD
    entry["checked"] = CHECKED[backward]
    bad, unresolved = _bisect(runner, batch, size, backward)
    entry.update(bad=bad, unresolved=unresolved)
    if bad and not unresolved and len(bad) < size:
        rest = sorted(set(range(size)) - set(bad))
        rest_outcome = runner.run(part(batch, rest, size), backward)
        entry["rest_clean"] = None if rest_outcome == CAPPED else rest_outcome == CLEAN
    if key is not None:
        ids, entry["note"] = sample_ids(batch, key, size)
        entry["ids"] = None if ids is None else [ids[i] for i in bad]
    return entry


def _bisect(runner: Runner, batch: Mapping[str, Any], size: int, backward: bool
            ) -> tuple[list[int], list[dict[str, Any]]]:
    """Halves of bad parts, breadth first: the bad samples found alone, and the parts that could
    not be split further (with why)."""
    bad: list[int] = []
    unresolved: list[dict[str, Any]] = []
    queue = deque([(0, size)])
    while queue:
        lo, hi = queue.popleft()
        if hi - lo == 1:
            bad.append(lo)
            continue
        halves = [(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)]
        outcomes = [runner.run(part(batch, list(range(a, b)), size), backward) for a, b in halves]
        if CAPPED in outcomes:
            unresolved += [_group(a, b, f"not split further: the cap of {runner.max_runs} runs was reached")
                           for a, b in [(lo, hi), *queue]]
            break
        failed = [(h, o) for h, o in zip(halves, outcomes) if o not in (CLEAN, FORWARD, BACKWARD)]
        if len(failed) == len(halves):
            failed = [((lo, hi), failed[0][1])]  # neither half runs alone: the part stays whole
        unresolved += [_group(a, b, f"could not run alone: {o}") for (a, b), o in failed]
        bad_halves = [h for h, o in zip(halves, outcomes) if o in (FORWARD, BACKWARD)]
        if not bad_halves and not failed:
            unresolved.append(_group(lo, hi, "bad only together: neither half alone is bad (the model mixes"
                                             " samples, or the fault needs several of them)"))
        queue.extend(bad_halves)
    return sorted(bad), unresolved


def _group(start: int, stop: int, why: str) -> dict[str, Any]:
    return {"from": start, "to": stop, "why": why}
