"""``nanguard coordinator``: run the daemon until SIGTERM or SIGINT.

With no option at all it serves on loopback (tcp://127.0.0.1:5555, /metrics on 127.0.0.1:9464),
logging to ./nanguard-coordinator.jsonl: a new user's first command works as it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import zmq
from prometheus_client import CollectorRegistry

from ..config import setting_from_env
from ..errors import ConfigError
from ..protocol import KINDS, parse_address
from .metrics import MetricsServer
from .policy import Policy
from .ranks import DEFAULT_MAX_WORLD_SIZE
from .server import Coordinator
from .stop import ON_RESTART

DEFAULT_LOG = "nanguard-coordinator.jsonl"
DEFAULT_LOG_MAX_MB = 256.0
DEFAULT_LOG_KEEP = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="tcp://127.0.0.1:5555",
                        help="ZeroMQ address to listen on; port 0 or * picks a free one (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=9464,
                        help="port of the Prometheus /metrics endpoint; 0 picks a free one (default %(default)s)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics endpoint listens on; /metrics has no authentication, so "
                             "keep it on a private interface. At most 32 connections are served at once and "
                             "one idle for 5 s is closed (default %(default)s)")
    parser.add_argument("--log", default=DEFAULT_LOG,
                        help="JSON-lines file every accepted message is appended to (default: "
                             "%(default)s in the working directory)")
    parser.add_argument("--log-max-mb", type=float, default=DEFAULT_LOG_MAX_MB,
                        help="rotate the log past this size: LOG becomes LOG.1, LOG.1 LOG.2, ... (default "
                             "%(default)g MB; 0: never). A log that cannot be written (a full disk) costs its "
                             "lines, counted in nanguard_log_errors_total, never the coordinator")
    parser.add_argument("--log-keep", type=int, default=DEFAULT_LOG_KEEP,
                        help="rotated logs kept, the oldest deleted first (default %(default)s)")
    parser.add_argument("--state",
                        help="state file that keeps the job's stop across a restart of the coordinator, "
                             "written atomically when the stop changes (default: beside the log, "
                             "LOG without .jsonl plus .state.json)")
    parser.add_argument("--on-restart", choices=ON_RESTART, default="stop",
                        help="what a torchrun restart of a stopped launch gets (same run id, a higher "
                             "TORCHELASTIC_RESTART_COUNT): stop (default: it would replay the steps that "
                             "went non-finite, so the stop holds and it stops at its first step) or run. A new "
                             "launch (restart count back to 0, or new ranks once every rank of the stopped "
                             "launch ended) always runs; nanguard clear lifts a stop by hand")
    parser.add_argument("--job", help="serve only this job id (default: the first one a rank names)")
    parser.add_argument("--max-world-size", type=int, default=DEFAULT_MAX_WORLD_SIZE,
                        help="refuse jobs of more ranks than this (default %(default)s)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback --bind without NANGUARD_TOKEN (anyone who can reach "
                             "the port can then act as a rank, and without NANGUARD_OPERATOR_TOKEN stop the "
                             "job)")
    parser.add_argument("--stop-after", type=int, default=1,
                        help="stop after non-finite values in this many distinct steps (default 1: the first)")
    parser.add_argument("--window-s", type=float, default=60.0,
                        help="...within this many seconds (default %(default)s)")
    parser.add_argument("--warn-kinds", default="",
                        help=f"comma-separated event kinds that never stop the job (of {', '.join(KINDS)})")
    parser.add_argument("--count-skipped", action="store_true",
                        help="count events of steps that ranks skipped (on_nan=skip) towards --stop-after")
    parser.add_argument("--dead-after-s", type=float, default=15.0,
                        help="a rank silent this long counts as dead (default %(default)s)")
    parser.add_argument("--stall-after-s", type=float, default=300.0,
                        help="an alive rank whose step has not moved this long counts as stalled "
                             "(default %(default)s)")


def state_beside(log_path: str) -> str:
    """The default state file of a log: ``x.jsonl`` -> ``x.state.json``."""
    stem, extension = os.path.splitext(log_path)
    return f"{stem if extension == '.jsonl' else log_path}.state.json"


def is_loopback(bind: str) -> bool:
    """True for addresses only this machine can reach: loopback TCP, ipc://, inproc://."""
    try:
        return parse_address(bind, bind=True).is_loopback
    except ValueError:  # not an address; binding it fails with ZeroMQ's own message
        return False


def _refusal(args: argparse.Namespace, token: str | None) -> str | None:
    """Why the daemon must not start (--bind or --metrics-port no address, or an open port without
    a token), or None: checked before anything is opened."""
    try:
        address = parse_address(args.bind, bind=True, label=f"--bind {args.bind!r}")
    except ValueError as exc:
        return f"{exc}; nothing was started"
    if address.scheme == "inproc":
        return (f"--bind {args.bind!r}: no other process can reach an inproc:// address; use tcp:// or "
                "ipc://; nothing was started")
    if not 0 <= args.log_max_mb < float("inf") or args.log_keep < 0:
        return (f"--log-max-mb {args.log_max_mb:g} and --log-keep {args.log_keep} must not be negative (--log-max-mb "
                "0: never rotate); nothing was started")
    if not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port {args.metrics_port} is not a port (0-65535); nothing was started"
    if token is None and not address.is_loopback and not args.insecure:
        return (f"refusing to listen on {args.bind} without a token: set NANGUARD_TOKEN (the same on every "
                "rank), bind a loopback address, or pass --insecure")
    return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        token, operator_token, curve_secret_key = (setting_from_env(name) for name in
                                                   ("token", "operator_token", "curve_secret_key"))
        warn_kinds = tuple(k.strip() for k in args.warn_kinds.split(",") if k.strip())
        policy = Policy(warn_kinds=warn_kinds, stop_after=args.stop_after, window_s=args.window_s,
                        ignore_skipped=not args.count_skipped)
    except ConfigError as exc:
        print(f"nanguard coordinator: {exc}; not started", file=sys.stderr)
        return 2
    problem = _refusal(args, token)
    if problem is not None:
        print(f"nanguard coordinator: {problem}", file=sys.stderr)
        return 2
    _raise_descriptor_limit()
    registry = CollectorRegistry()
    context = daemon_context()
    log_path = os.path.abspath(args.log)
    state_path = os.path.abspath(args.state or state_beside(log_path))
    try:
        coordinator = Coordinator(args.bind, token=token, operator_token=operator_token,
                                  curve_secret_key=curve_secret_key, registry=registry, log_path=log_path,
                                  policy=policy, job=args.job, max_world_size=args.max_world_size,
                                  dead_after_s=args.dead_after_s, stall_after_s=args.stall_after_s,
                                  context=context, state_path=state_path, log_keep=args.log_keep,
                                  log_max_bytes=int(args.log_max_mb * 1e6) or None, on_restart=args.on_restart)
    except ValueError as exc:
        print(f"nanguard coordinator: {exc}; not started", file=sys.stderr)
        return 2
    try:
        coordinator.start()
    except OSError as exc:
        print(f"nanguard coordinator: {exc}", file=sys.stderr)
        return 1
    try:
        metrics = MetricsServer(registry, args.metrics_host, args.metrics_port)
    except OSError as exc:
        coordinator.close()
        print(f"nanguard coordinator: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: "
              f"{exc}; stopped", file=sys.stderr)
        return 1
    _warn_about_access(token, operator_token, args.metrics_host)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: coordinator.shutdown())
    print(f"nanguard coordinator ready bind={coordinator.address} metrics={metrics.url} log={log_path} "
          f"state={state_path}", flush=True)
    try:
        return coordinator.serve_forever()
    finally:
        metrics.close()


def daemon_context() -> zmq.Context:
    """The daemon's ZeroMQ context. Two I/O threads: a stop to a thousand ranks is a thousand TCP
    writes (a bare ZeroMQ fan-out to 1,024 local DEALERs on 2 cores took ~30 ms with two, ~35-50 ms
    with one). Each received message copied out of libzmq's read buffer (``ZMQ_ZERO_COPY_RECV`` 0):
    by default a message borrows a piece of that buffer (~18 KiB, one per read of a connection), and
    the whole buffer stays while any message in it waits to be read; with 2,048 connections each with
    a few messages queued, that was ~35 MB more at the peak, left behind as free heap once read. A
    copy is a few hundred bytes a message. (The manual marks the option draft; pyzmq's libzmq 4.3.5,
    built without the draft API, takes it, and a libzmq that refuses it keeps its default.)"""
    context = zmq.Context(io_threads=2)
    try:
        context.set(ZERO_COPY_RECV, 0)
    except zmq.ZMQError as exc:
        logging.getLogger("nanguard.coordinator").debug("libzmq keeps its zero-copy receive (%s)", exc)
    return context


ZERO_COPY_RECV = 10
"""zmq_ctx_set's ZMQ_ZERO_COPY_RECV (pyzmq names no constant for it)"""


def _raise_descriptor_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one: every rank's connection is one, and
    a 16,384-rank job needs more than the usual soft limit of 1,024."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Linux refuses an unlimited descriptor limit (above fs.nr_open, 1,048,576 by default)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logging.getLogger("nanguard.coordinator").warning(
            "cannot raise the open-descriptor limit from %d to %d (%s): a job of more ranks than that needs "
            "`ulimit -n` raised before the coordinator starts", soft, target, exc)
        return
    logging.getLogger("nanguard.coordinator").info("open-descriptor limit raised from %d to %d", soft, target)


def _warn_about_access(token: str | None, operator_token: str | None, metrics_host: str) -> None:
    """Say at start who can do what with the secrets given (README, Security)."""
    log = logging.getLogger("nanguard.coordinator")
    if operator_token is None and token is not None:
        log.warning("no NANGUARD_OPERATOR_TOKEN: `nanguard stop` and `nanguard clear` are refused (stopping a "
                    "job or lifting its stop needs the operator credential, which ranks never hold); `nanguard "
                    "status` works with NANGUARD_TOKEN")
    elif operator_token is None:
        log.warning("no NANGUARD_TOKEN nor NANGUARD_OPERATOR_TOKEN: whoever reaches the port can act as a "
                    "rank, stop the job and lift its stop (fine for a loopback port on a machine of your own)")
    if not is_loopback(f"tcp://[{metrics_host}]:1" if ":" in metrics_host else f"tcp://{metrics_host}:1"):
        log.info("/metrics on %s has no authentication: keep that interface private", metrics_host)
