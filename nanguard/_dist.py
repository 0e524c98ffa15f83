"""torch.distributed as nanguard meets it: who this process is (built once), the few collectives
nanguard runs (over one process group, not necessarily the world), and ending a process group so
that the process can exit.

Objects go between ranks as bytes in a uint8 tensor (``_exchange_bytes``), never through torch's
``all_gather_object`` / ``broadcast_object_list``: torch 2.13 reads their bytes back with
``tensor.numpy()``, so without numpy (nanguard does not require it) every rank died with "Numpy is
not available" at the one step nanguard had to stop.

Why ending needs care (torch 2.13, gloo; seen here as SIGABRT "terminate called without an active
exception" after training had ended, in about 1 run of 40 on a loaded machine):

- gloo runs collectives on worker threads (``pt_gloo_runloop``). A worker drops its last reference
  to a finished collective a moment after the caller has seen it complete; when that collective
  held a tensor that Python also knows, dropping it needs the GIL.
- If the main thread has meanwhile reached interpreter finalization, taking the GIL makes the
  worker call ``pthread_exit``, which unwinds through a C++ ``noexcept`` destructor:
  ``std::terminate``, and the process dies of SIGABRT although the script succeeded.
- ``dist.destroy_process_group()`` would end those threads (the group's destructor joins them),
  but only once nothing references the group. A ``DistributedDataParallel`` model does, until it is
  freed; and importing DDP imports ``torch.distributed.nn.functional``, whose functions take
  ``group=group.WORLD`` as default argument values, evaluated at import: ten references to the
  default group that live as long as the process. So the group, and its threads, outlive
  ``destroy_process_group`` in every DDP script. FSDP2 (DTensor) keeps its device mesh, and
  with it the group, alive from outside Python's view.

``destroy_process_group()`` here does what a script means by it: the group is destroyed, torch's
stale references to it are dropped, and gloo's threads are joined before Python finalizes.
``settle_gloo_workers()`` is the fallback where something still holds the group: it waits,
without holding the GIL, until every worker is parked.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any

from .protocol import job_name

log = logging.getLogger("nanguard")

_GLOO_WORKER = "pt_gloo_runloop"
_SETTLE_POLL_S = 0.005


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _initialized():
    """``torch.distributed`` when a process group is initialized, else None (asked every step:
    the module comes from sys.modules, not through an import statement)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What does not change for the life of this process: read once, from torchrun's environment."""

    local_rank: int
    host: str
    pid: int
    run_id: str | None
    """TORCHELASTIC_RUN_ID: the same on every rank of a job, and across its restarts"""
    restart: int = 0
    """TORCHELASTIC_RESTART_COUNT: how many times the job's workers were restarted"""
    local_world_size: int = 1
    """LOCAL_WORLD_SIZE: the ranks on this node"""
    node: str = ""
    """GROUP_RANK (torchrun's node rank) and MASTER_ADDR:MASTER_PORT: with the run id and the restart,
    what names this node's relay (``relay.local_address``)"""

    @property
    def job(self) -> str:
        """The job as the coordinator knows it (a run id too long for the wire is shortened)."""
        return job_name(self.run_id)

    @property
    def incidents_as(self) -> str | None:
        """What incident folder names start with: the run id, and the restart when there was one
        (a restarted job replays the same steps: its incidents must not read as the first run's)."""
        if self.restart and self.run_id:
            return f"{self.run_id}-restart{self.restart}"
        return self.run_id or (f"restart{self.restart}" if self.restart else None)

    @classmethod
    def from_env(cls) -> RankInfo:
        return cls(local_rank=_env_int("LOCAL_RANK", 0), host=socket.gethostname(), pid=os.getpid(),
                   run_id=os.environ.get("TORCHELASTIC_RUN_ID") or None,
                   restart=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
                   local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
                   node="\0".join(os.environ.get(name, "") for name in ("GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")))


class Collectives:
    """The collectives nanguard runs, over ``group`` (None: the default group). Before the group
    exists, or without ``torch.distributed``, this process is a job of its own (rank and world
    size as torchrun announced them, ``active`` False)."""

    def __init__(self, group: Any = None):
        self.group = group

    @property
    def active(self) -> bool:
        return _initialized() is not None

    @property
    def rank(self) -> int:
        dist = _initialized()
        return dist.get_rank(self.group) if dist is not None else _env_int("RANK", 0)

    @property
    def world_size(self) -> int:
        """The job's world size; before ``init_process_group``, what torchrun says it will be."""
        dist = _initialized()
        return dist.get_world_size(self.group) if dist is not None else _env_int("WORLD_SIZE", 1)

    def device(self):
        """Where this group's tensors must be: the current GPU under NCCL, else the CPU."""
        import torch

        dist = _initialized()
        if dist is not None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce(self, tensor) -> None:
        """Sum ``tensor`` over the group, in place (nothing to do alone)."""
        dist = _initialized()
        if dist is not None:
            dist.all_reduce(tensor, group=self.group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as the group's rank ``src`` has it."""
        dist = _initialized()
        if dist is None:
            return obj
        sender = dist.get_rank(self.group) == src
        data = self._exchange_bytes(dist, _encode(obj) if sender else None, src)[0]
        return obj if sender else _decode(data)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank within the group."""
        dist = _initialized()
        if dist is None:
            return [obj]
        return [_decode(data) for data in self._exchange_bytes(dist, _encode(obj))]

    def _exchange_bytes(self, dist: Any, data: bytes | None, src: int | None = None) -> list[bytes]:
        """Every rank's ``data`` by rank (``src`` None: an all-gather), or ``[src's data]`` on
        every rank (a broadcast; the others pass None). Two collectives: the lengths, then the
        bytes padded to the longest, on the group's device."""
        import torch

        device = self.device()
        length = torch.tensor([len(data or b"")], dtype=torch.int64, device=device)
        if src is None:
            lengths = [torch.empty_like(length) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(lengths, length, group=self.group)
            sizes = torch.cat(lengths).tolist()
        else:
            dist.broadcast(length, group=self.group, group_src=src)
            sizes = length.tolist()
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(device)
        if src is None:
            chunks = [torch.empty_like(mine) for _ in sizes]
            dist.all_gather(chunks, mine, group=self.group)
        else:
            dist.broadcast(mine, group=self.group, group_src=src)
            chunks = [mine]
        return [_bytes_of(chunk[:size]) for chunk, size in zip(chunks, sizes)]

    def barrier(self) -> None:
        dist = _initialized()
        if dist is not None:
            dist.barrier(group=self.group)


def _encode(obj: Any) -> bytes:
    """What a rank sends: pickle, as torch's own object collectives use, because what goes over
    includes a micro-batch's arguments as the script made them (any picklable object, tensors as
    torch pickles them). Only the ranks of one process group read it, which run the same code and
    already trust each other through the group's store."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(data: bytes) -> Any:
    return pickle.loads(data)  # a peer rank of this job's own group (see _encode)


def _bytes_of(tensor: Any) -> bytes:
    """A 1-D uint8 tensor's bytes (no numpy: ``Tensor.numpy`` needs it)."""
    tensor = tensor.cpu().contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel()) if tensor.numel() else b""


def destroy_process_group(timeout_s: float = 5.0) -> bool:
    """End this process's ``torch.distributed`` state so that it can exit cleanly.

    Call it at the very end, once the model that used the group (a ``DistributedDataParallel``
    or FSDP model, and a trainer holding one) is freed: after ``main()`` returns, for example.
    It collects garbage (models in reference cycles), destroys every process group if one is
    initialized, drops torch's own stale references to the destroyed default group and checks
    that gloo's worker threads have ended. Where they have not (FSDP2, or a model still
    referenced, which is logged as a warning with what holds the group), it waits, at most
    ``timeout_s``, until they are idle (``settle_gloo_workers``). Returns True when no gloo
    worker can still hold a finished collective: the process may exit. Never a collective: a
    rank whose peers are gone does not wait for them.
    """
    import torch.distributed as dist

    from ._torch.patches import release_destroyed_groups

    if not dist.is_available():
        return True
    gc.collect()
    groups = []
    if dist.is_initialized():
        groups.append(weakref.ref(dist.group.WORLD))
        dist.destroy_process_group()
    groups += [weakref.ref(group) for group in release_destroyed_groups()]
    gc.collect()
    if not _tasks(_GLOO_WORKER):
        return True
    alive = [group() for group in groups if group() is not None]
    holders = sorted({name for group in alive for name in _holders(group)})
    del alive
    if holders:
        log.warning("nanguard: gloo's worker threads outlive the destroyed process group, which %s "
                    "still reference(s); free the model before calling nanguard.destroy_process_group()"
                    " (docs/usage.md, 'Ending a distributed script'); waiting for the workers to go idle",
                    ", ".join(holders))
    settled = settle_gloo_workers(timeout_s)
    if not settled:
        log.warning("nanguard: gloo's worker threads were still busy after %.1f s; the process may "
                    "abort as it exits (a collective still in flight?)", timeout_s)
    return settled


def settle_gloo_workers(timeout_s: float = 2.0) -> bool:
    """Wait until every gloo worker thread is parked (asleep, and not woken over an interval in
    which this thread did not hold the GIL), so none is left holding a finished collective when
    Python finalizes. True when they are (or there are none, or this is not Linux)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        now = {tid: _sched(tid) for tid in _tasks(_GLOO_WORKER)}
        if not now or (now == last and all(state == "S" for state, _ in now.values())):
            return True
        if time.monotonic() >= deadline:
            return False
        last = now
        time.sleep(_SETTLE_POLL_S)  # the GIL is free meanwhile: a worker waiting for it gets it


def _holders(obj: object) -> list[str]:
    """Type names of the Python objects that reference ``obj`` through their attributes."""
    names = []
    for referrer in gc.get_referrers(obj):
        if isinstance(referrer, dict):
            names += [type(owner).__name__ for owner in gc.get_referrers(referrer)
                      if getattr(owner, "__dict__", None) is referrer]
    return names


def _tasks(name: str) -> list[str]:
    """Thread ids of this process's threads called ``name`` (Linux; elsewhere none)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    found.append(tid)
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _sched(tid: str) -> tuple[str, str]:
    """A thread's state letter and its context-switch counts ("" once it has ended)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/self/task/{tid}/status") as f:
            switches = " ".join(line.split()[1] for line in f if "ctxt_switches" in line)
    except (OSError, IndexError):
        return "", ""
    return state, switches
