"""Every random state of a process: taken at the start of a step, kept on disk, put back for a replay."""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any

import torch


def optional_numpy():
    """numpy, or None where it is not installed (nanguard does not require it)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def cuda_in_use() -> bool:
    # Never create a CUDA context just to read a state: a CPU job on a GPU host would pay for
    # one on every rank, and a CUDA that was never initialised has drawn no random numbers.
    return torch.cuda.is_initialized()  # initialised implies available (and is cheaper to ask)


HOST = ("python", "numpy")
"""generators a training step does not draw from (its forward, backward and update draw from
torch's): the per-step snapshot leaves them out, the capture reads them"""


def rng_snapshot(host: bool = True) -> dict[str, Any]:
    """Every RNG state of this process: python, numpy (if the process imported it), torch CPU,
    each CUDA device in use. Only raw copies here, no device sync; ``rng_record`` turns them into
    what ``torch.load(weights_only=True)`` reads back. Reading python's and numpy's states costs
    about 9 and 80 us, so the snapshot taken as each step begins leaves them out (``host=False``)
    and the capture adds them. torch's CPU state is kept as a cloned generator, not as the 5 KB
    state tensor: inside a training step the clone costs a few microseconds where allocating and
    filling the tensor cost 60-160 (measured in situ); ``torch_state`` makes the tensor when needed."""
    module = sys.modules.get("numpy") if host else None  # never imported: nothing drawn from it
    return {
        "python": random.getstate() if host else None,
        "numpy": module.random.get_state(legacy=False) if module is not None else None,
        "torch": torch.default_generator.clone_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if cuda_in_use() else [],
    }


def host_fingerprint() -> tuple:
    """Python's and numpy's global random states, comparable with ``==``: whether code run between
    two readings drew from them (numpy's only once the process imported it)."""
    module = sys.modules.get("numpy")
    state = module.random.get_state(legacy=False) if module is not None else None
    return random.getstate(), None if state is None else (
        state["state"]["key"].tobytes(), state["state"]["pos"], state["has_gauss"], state["gauss"])


def torch_state(value: torch.Tensor | torch.Generator) -> torch.Tensor:
    """torch's CPU RNG state as ``torch.set_rng_state`` takes it, from a snapshot's value."""
    return value.get_state() if isinstance(value, torch.Generator) else value


def rng_record(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot as rng.pt holds it: numpy's state as plain values and an int64 tensor, which
    ``torch.load(weights_only=True)`` reads back (numpy arrays it refuses)."""
    record = dict(snapshot)
    if "torch" in record:
        record["torch"] = torch_state(record["torch"])
    state = snapshot.get("numpy")
    if state is not None and "state" in state:
        numpy = optional_numpy()
        record["numpy"] = {
            "bit_generator": state["bit_generator"],
            # uint32 -> int64: a dtype every torch version saves and loads
            "key": torch.from_numpy(state["state"]["key"].astype(numpy.int64)),
            "pos": int(state["state"]["pos"]),
            "has_gauss": int(state["has_gauss"]),
            "gauss": float(state["gauss"]),
        }
    return record


def _numpy_state(state: Mapping[str, Any], numpy: Any) -> dict[str, Any]:
    """numpy's state as ``numpy.random.set_state`` takes it, from its record in rng.pt."""
    return {
        "bit_generator": state["bit_generator"],
        "state": {"key": state["key"].numpy().astype(numpy.uint32), "pos": state["pos"]},
        "has_gauss": state["has_gauss"],
        "gauss": state["gauss"],
    }


def rng_restore(snapshot: Mapping[str, Any]) -> list[str]:
    """Puts back the states of ``rng_snapshot()``; returns notes on what could not be restored.

    A replay on a machine without numpy or with fewer (or no) GPUs still runs: the notes say
    which random numbers will differ, so the replay report can say so.
    """
    notes = []
    if snapshot.get("python") is not None:
        random.setstate(snapshot["python"])
    torch.set_rng_state(torch_state(snapshot["torch"]))
    state = rng_record(snapshot).get("numpy")
    if state is not None:
        numpy = optional_numpy()
        if numpy is None:
            notes.append("numpy's random state was not restored: numpy is not installed here")
        else:
            numpy.random.set_state(_numpy_state(state, numpy))
    cuda = snapshot.get("cuda") or []
    if cuda:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for device, state in enumerate(cuda[:available]):
            torch.cuda.set_rng_state(state, device)
        if available < len(cuda):
            notes.append(f"the CUDA random state of {len(cuda) - available} of {len(cuda)} device(s) was "
                         f"not restored: this machine has {available} GPU(s); random numbers drawn "
                         "on those devices will differ from the original run")
    return notes


def check_record(record: Any) -> str | None:
    """What is wrong with an rng.pt's content (``rng_record``'s form), or None when
    ``rng_restore`` can put it back: each state is tried on a scratch generator, none of this
    process's states changes."""
    if not isinstance(record, Mapping) or not isinstance(record.get("torch"), torch.Tensor):
        return "it is not a record of random states with torch's"
    try:
        if record.get("python") is not None:
            random.Random().setstate(record["python"])
        torch.Generator().set_state(record["torch"])
    except Exception as exc:  # noqa: BLE001 (whatever a crafted state makes a generator raise)
        return f"a random state does not fit its generator ({exc})"
    state = record.get("numpy")
    if state is not None and not (isinstance(state, Mapping) and isinstance(state.get("bit_generator"), str)
                                  and isinstance(state.get("key"), torch.Tensor)
                                  and all(type(state.get(k)) is int for k in ("pos", "has_gauss"))
                                  and type(state.get("gauss")) is float):
        return "numpy's random state is not as nanguard writes it"
    numpy = optional_numpy()
    if state is not None and numpy is not None:
        try:
            numpy.random.RandomState().set_state(_numpy_state(state, numpy))
        except Exception as exc:  # noqa: BLE001
            return f"numpy's random state does not fit its generator ({exc})"
    cuda = record.get("cuda")
    cuda = [] if cuda is None else cuda
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
        return "the CUDA random states are not a list of byte tensors"
    return None
