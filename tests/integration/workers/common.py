"""Shared code of the integration workers: the model, the faults, the training loop, JSON out.

Each worker script is a thin ``main()`` over ``run()``; everything a test asserts on is
written by ``run()`` to ``OUT_DIR/rank{RANK}.json`` (atomically), one file per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import signal
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import nanguard

WIDTH = 16
FAULTS = ("none", "forward", "input", "backward", "backward-one", "backward-huge", "after-backward", "kill", "weight")


# --------------------------------------------------------------------------- faults
class _NaNGrad(torch.autograd.Function):
    """Identity forward; the backward returns NaN: a value born in the backward pass."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class _OneNaNGrad(_NaNGrad):
    """The backward makes one NaN, in the gradient's first element: under FSDP2 it lands in
    rank 0's shard of the module's weight, whichever rank made it."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad


class _HugeGrad(_NaNGrad):
    """The backward makes the gradient huge but finite in float32: 1e9 times, past float16's range."""

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e9


class Fault(nn.Module):
    """A parameter-free leaf module that misbehaves while ``mode`` is set, and from then on whenever it
    is fed the same input again (a fault of the data: nanguard's microscope re-runs the step and meets
    it again). ``once``: only while ``mode`` is set (a fault of the moment, as a device's would be)."""

    def __init__(self):
        super().__init__()
        self.mode: str | None = None
        self.once = False
        self.seen: dict[tuple, str] = {}

    def forward(self, x):
        key = (tuple(x.shape), x.detach().double().sum().item())
        if self.mode is not None and not self.once:
            self.seen[key] = self.mode
        mode = self.mode if self.mode is not None else self.seen.get(key)
        if mode == "forward":
            return torch.log(-1.0 - x.abs())  # log of a negative number: NaN
        if mode == "backward":
            return _NaNGrad.apply(x)
        if mode == "backward-one":
            return _OneNaNGrad.apply(x)
        if mode == "backward-huge":
            return _HugeGrad.apply(x)
        return x


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.Tanh()
        self.fault = Fault()

    def forward(self, x):
        return self.fault(self.act(self.fc(x)))


class SyncMean(nn.Module):
    """Centres its input by its mean over every rank, as a synchronised norm does: a collective in
    the forward, which spreads a NaN of one rank to the others."""

    def forward(self, x):
        mean = x.detach().mean(0)
        dist.all_reduce(mean)
        return x - mean / dist.get_world_size()


class GradSyncMean(nn.Module):
    """A cross-rank mean that autograd follows (torch.distributed.nn's all_reduce), as a
    synchronised batch norm's statistics are: its backward all-reduces gradients too, and so hands
    a NaN born in one rank's backward to the others."""

    def forward(self, x):
        from torch.distributed.nn.functional import all_reduce

        return x - all_reduce(x.mean(0)) / dist.get_world_size()


class Net(nn.Module):
    def __init__(self, width: int = WIDTH, synced: bool = False, sync_grad: bool = False):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.sync = GradSyncMean() if sync_grad else nn.Identity()
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Sequential(SyncMean(), nn.Linear(width, 4)) if synced else nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.blocks(self.sync(self.embed(x))))


#: the qualified name (no DDP/FSDP prefix) of the module the forward/backward faults live in
FAULT_LAYER = "blocks.1.fault"
#: the first module a bad input batch reaches
FIRST_LAYER = "embed"


# --------------------------------------------------------------------------- digests
def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # DTensor (FSDP2): this rank's shard
    if type(tensor) is not torch.Tensor and to_local is not None:
        tensor = to_local()
    return tensor.detach().cpu().contiguous()


def _feed(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        h.update(f"T{local.dtype}{tuple(local.shape)}".encode())
        h.update(local.numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _feed(h, item)
    else:
        h.update(repr(obj).encode())


def digest(obj: Any) -> str:
    """Bit-exact fingerprint of a (nested) state: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def weights_digest(model: nn.Module) -> str:
    return digest(model.state_dict())


def optim_digest(optimizer: torch.optim.Optimizer) -> str:
    # (a ZeroRedundancyOptimizer's whole state is on no rank: its local optimizer's is this rank's)
    return digest(getattr(optimizer, "optim", optimizer).state_dict())


def all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters())


# --------------------------------------------------------------------------- output
def write_json(out_dir: str, rank: int, data: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{rank}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- training
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-node", type=int, default=None,
                   help="fault on the process whose NG_TEST_NODE equals this (not by rank)")
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--fault-until", type=int, default=None,
                   help="the fault hits every step from --fault-step up to this one, excluded (a storm)")
    p.add_argument("--fault-micro", type=int, default=0)
    p.add_argument("--synced", action="store_true", help="a cross-rank mean (SyncMean) before the head")
    p.add_argument("--fp16-hook", action="store_true", help="DDP's fp16_compress_hook sums the gradients")
    p.add_argument("--fp16-hook-after-init", action="store_true",
                   help="the same, registered after nanguard.init (nanguard's own hook calls it)")
    p.add_argument("--hand-sum", action="store_true",
                   help="no DDP: the script all-reduces the gradients itself after its own code")
    p.add_argument("--sync-grad", action="store_true",
                   help="a cross-rank mean after embed whose backward all-reduces gradients (GradSyncMean)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--skip-nan-loss", action="store_true",
                   help="every rank drops a micro-batch, before its backward pass, whose loss is not finite on some rank")
    p.add_argument("--eval-nan-step", type=int, default=None,
                   help="after this step, every rank evaluates (autograd off); the faulty rank's batch holds a NaN")
    p.add_argument("--sync-every-micro", action="store_true",
                   help="DDP sums the gradients of every micro-batch (no no_sync)")
    p.add_argument("--rewrap-step", type=int, default=None,
                   help="every rank wraps the model again (a new DDP) at this step, and lets the old one go")
    p.add_argument("--zero", action="store_true", help="a ZeroRedundancyOptimizer shards AdamW's state across ranks")
    p.add_argument("--on-nan", default="raise")
    p.add_argument("--mode", default=None, help="nanguard's mode (sentinel, full); default: nanguard's")
    p.add_argument("--fault-once", action="store_true",
                   help="the fault is of the moment: a re-run of the step does not meet it (a device's)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep in every step")
    p.add_argument("--warn-every-step", action="store_true",
                   help="a grad-norm warning event on every step (an event storm)")
    p.add_argument("--progress-file", default=None,
                   help="rank 0 writes the number of steps done here after every step")
    return p


def _bad_anywhere(loss: torch.Tensor) -> bool:
    """Whether the loss is non-finite on some rank (agreed: every rank drops the same micro-batch)."""
    bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0])
    dist.all_reduce(bad)
    return bool(bad.item())


def _is_faulty_process(args, rank: int) -> bool:
    if args.fault_node is not None:
        return os.environ.get("NG_TEST_NODE") == str(args.fault_node)
    return rank == args.fault_rank


def run(args: argparse.Namespace, wrap) -> int:
    """Train ``wrap(Net())`` with AdamW under ``nanguard.init(model, optimizer)``.

    ``wrap(net)`` returns ``(model, no_sync)``: the wrapped model and a context-manager
    factory used for every micro-batch but the last (``nullcontext`` when not applicable).
    """
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net(synced=args.synced, sync_grad=args.sync_grad)
    model, no_sync = wrap(net)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    overrides = {"grad_norm_warn": 1e-12} if args.warn_every_step else {}
    if args.mode is not None:
        overrides["mode"] = args.mode
    guard = nanguard.init(model, optimizer, on_nan=args.on_nan, **overrides)
    if args.fp16_hook_after_init:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    generator = torch.Generator().manual_seed(100 + rank)
    faulty = _is_faulty_process(args, rank)
    fault_module = net.blocks[1].fault
    fault_module.once = args.fault_once
    result: dict[str, Any] = {
        "rank": rank, "world": world, "host": socket.gethostname(),
        "node": os.environ.get("NG_TEST_NODE"), "faulty": faulty,
        "step_digests": [], "steps_done": 0, "error": None, "exception": None, "stop": None,
    }
    before: dict[str, str] = {}
    step = -1
    try:
        for step in range(args.steps):
            if faulty and step == args.fault_step and args.fault == "weight":
                with torch.no_grad():  # this rank's own copy, or shard (FSDP2), of a weight: before the step
                    _local(net.blocks[1].fc.weight)[0, 0] = float("nan")
            if step == args.rewrap_step:  # as a script does to sync a module added during training
                model, no_sync = wrap(net)
            result["step_digests"].append(weights_digest(model))
            for micro in range(args.accum):
                x = torch.randn(8, 8, generator=generator)
                y = torch.randint(0, 4, (8,), generator=generator)
                last_fault = args.fault_step if args.fault_until is None else args.fault_until - 1
                hit = faulty and args.fault_step <= step <= last_fault and micro == args.fault_micro
                if hit and args.fault == "kill":  # the process dies as by the OOM killer: no exit code, no atexit
                    os.kill(os.getpid(), signal.SIGKILL)
                if hit and args.fault == "input":
                    x[0, 0] = float("nan")
                fault_module.mode = args.fault if hit and args.fault.startswith(("forward", "backward")) else None
                last = micro == args.accum - 1
                with contextlib.nullcontext() if last else no_sync():
                    loss = nn.functional.cross_entropy(model(x), y) / args.accum
                    if args.skip_nan_loss and _bad_anywhere(loss):
                        optimizer.zero_grad()  # the script's own guard: that micro-batch makes no update
                        continue
                    loss.backward()
                fault_module.mode = None
            if faulty and step == args.fault_step and args.fault == "after-backward":
                net.blocks[1].fc.weight.grad.div_(0.0)  # the script's own division by a count that was 0
            if args.hand_sum:
                for param in net.parameters():
                    dist.all_reduce(param.grad)
            # snapshot right before the step: an error must leave exactly this state behind
            before = {"weights": weights_digest(model), "optim": optim_digest(optimizer)}
            optimizer.step()
            optimizer.zero_grad()
            result["steps_done"] += 1
            if step == args.eval_nan_step:
                with torch.no_grad():  # an evaluation on every rank; the faulty rank's batch holds a NaN
                    x = torch.randn(8, 8)
                    x[0, 0] = float("nan") if faulty else 0.0
                    model(x)
            if args.progress_file and rank == 0:
                with open(args.progress_file + ".tmp", "w") as f:
                    f.write(str(result["steps_done"]))
                os.replace(args.progress_file + ".tmp", args.progress_file)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except nanguard.NonFiniteError as err:
        result["error"] = {
            "type": type(err).__name__,
            "is_runtime_error": isinstance(err, RuntimeError),
            "loop_step": step,
            "guard_step": guard.step,
            "event": err.event.to_dict(),
            "incident": err.incident,
            "message": str(err),
            "weights_before": before["weights"],
            "weights_after": weights_digest(model),
            "optim_before": before["optim"],
            "optim_after": optim_digest(optimizer),
        }
    except nanguard.StopRequested as err:
        result["stop"] = {
            "loop_step": step, "step": err.step, "reason": err.reason,
            "weights_before": before["weights"], "weights_after": weights_digest(model),
        }
    except BaseException:
        result["exception"] = traceback.format_exc()
        write_json(args.out_dir, rank, result)
        raise
    finally:
        fault_module.mode = None
    result["guard_step"] = guard.step
    result["skipped_steps"] = guard.skipped_steps
    result["final_weights"] = weights_digest(model)
    result["final_finite"] = all_finite(model)
    result["events"] = [e.to_dict() for e in guard.events]
    guard.close()
    write_json(args.out_dir, rank, result)
    return 0


def main(wrap) -> int:
    """A worker's entry point: ``run()``, then the end of the process group once run()'s model
    is freed; whether the exit was made safe is added to the rank's JSON."""
    args = parser().parse_args()
    try:
        code = run(args, wrap)
    except nanguard.ReplayFinished as exc:  # a replay ends the script at its optimizer step
        code = exc.code
    safe = nanguard.destroy_process_group()
    path = os.path.join(args.out_dir, f"rank{os.environ.get('RANK', '0')}.json")
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        write_json(args.out_dir, result["rank"], {**result, "exit_safe": safe})
    return code
