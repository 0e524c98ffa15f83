"""The ``nanguard`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo

    return demo(steps=args.steps, bad_step=args.bad_step, workdir=args.dir)


def _coordinator(args: argparse.Namespace) -> int:
    from .coordinator.main import run

    return run(args)


def _fail(args: argparse.Namespace, problem: object, code: int) -> int:
    """Say ``problem`` on one line of stderr (escaped: it may quote what a coordinator sent); ``code``."""
    from ._text import printable

    print(f"nanguard {args.command}: {printable(str(problem))}", file=sys.stderr)
    return code


def _ask(args: argparse.Namespace, type_: str, body: dict):
    """One operator request; the reply, or an exit code after saying what went wrong."""
    from .config import setting_from_env
    from .coordinator.control import check_timeout, request
    from .errors import ConfigError, CoordinatorUnreachable, ProtocolError, RequestRefused
    from .wire import check_body

    try:
        check_timeout(args.timeout_s, "--timeout-s")
    except ValueError as exc:
        return _fail(args, exc, 2)
    try:
        check_body(type_, body)
    except ProtocolError as exc:
        return _fail(args, f"the coordinator would refuse this request ({exc}); nothing was sent", 2)
    try:
        address = args.coordinator or setting_from_env("coordinator")
        token, operator_token, curve_public_key = (setting_from_env(name) for name in
                                                   ("token", "operator_token", "curve_public_key"))
    except ConfigError as exc:
        return _fail(args, exc, 2)
    address = address or args.loopback  # where a `nanguard coordinator` with no option listens
    try:
        return request(address, token, type_, body, operator_token=operator_token,
                       curve_public_key=curve_public_key, timeout_s=args.timeout_s)
    except (CoordinatorUnreachable, ProtocolError, RequestRefused) as exc:
        return _fail(args, exc, 1)
    except ValueError as exc:
        return _fail(args, exc, 2)


def _status(args: argparse.Namespace) -> int:
    import json

    reply = _ask(args, "status_request", {})
    if isinstance(reply, int):
        return reply
    if args.json:
        print(json.dumps(reply.body, indent=2))
        return 0
    print(format_status(reply.body, now=reply.time))
    return 0


def format_status(status: dict, now: float) -> str:
    """The ``status`` reply as a table; ``now`` is the coordinator's clock when it answered. Text
    from the coordinator is escaped (``_text.printable``): a coordinator, or a rank through it,
    must not drive the operator's terminal."""
    import time

    from ._text import printable as p

    rows = [("rank", "host", "link", "step", "last seen", "state", "events", "dropped")]
    for r in status["ranks"]:
        state = ("finished" if r["finished"] else "failed" if r["failed"] else "stalled" if r["stalled"]
                 else "alive" if r["alive"] else "dead")
        rows.append((str(r["rank"]), p(r["host"]) or "?", "relayed" if r.get("relayed") else "direct",
                     "?" if r["step"] is None else str(r["step"]),
                     f"{max(0.0, now - r['last_seen']):.1f} s ago", state, str(r["events"]),
                     str(r["dropped"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"job: {p(status['job'] or '(none yet)')}, {len(status['ranks'])} rank(s)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    stop = status["stop"]
    if stop is None:
        lines.append("stop: none")
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stop["time"]))
        why = p(stop["origin"]) + (f", counted as {p(stop['counted_as'])}" if "counted_as" in stop else "")
        of = "" if "job" not in stop else f" of job {p(stop['job'])}" + (
            "" if stop["restart"] is None else f" restart {stop['restart']}")
        lines.append(f"stop: command {p(stop['command_id'])}{of} ({why}) at {when}: {p(stop['reason'])}; "
                     f"acked by {len(stop['acked'])} of {len(status['ranks'])} rank(s); nanguard clear lifts it")
    return "\n".join(lines)


def _stop(args: argparse.Namespace) -> int:
    from ._text import printable

    reply = _ask(args, "stop_request", {"reason": args.reason})
    if isinstance(reply, int):
        return reply
    command_id = printable(reply.body["command_id"])
    if reply.body["existing"]:
        print(f"The job was already stopping (command {command_id}); that stop stands, this one was not sent "
              "again.")
    else:
        print(f"Stop command {command_id} sent: every rank stops at one common step, before its update; "
              "nanguard status shows which ranks have acknowledged it.")
    return 0


def _clear(args: argparse.Namespace) -> int:
    from ._text import printable

    reply = _ask(args, "clear_request", {"reason": args.reason})
    if isinstance(reply, int):
        return reply
    if reply.body["command_id"] is None:
        print("No stop was standing; nothing changed.")
    else:
        print(f"Stop command {printable(reply.body['command_id'])} lifted: ranks that register from now on run "
              "(ranks already stopping still stop).")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from .curve import keypair

    public, secret = keypair()
    print(f"# the coordinator's CurveZMQ key pair (nanguard keys): the secret to the coordinator only,\n"
          f"# the public key to the ranks and operators\nNANGUARD_CURVE_SECRET_KEY={secret}\n"
          f"NANGUARD_CURVE_PUBLIC_KEY={public}")
    return 0


_DESCRIPTION = ("nanguard stops a distributed PyTorch job at the first NaN or Inf, before the bad update, "
                "and saves what is needed to replay that step.")
_COORDINATOR_ENVIRONMENT = (
    "environment: NANGUARD_TOKEN, the shared secret every rank holds (needed to listen on a non-loopback "
    "address, unless --insecure); NANGUARD_OPERATOR_TOKEN, which nanguard stop and clear must show once it is "
    "set (ranks do not hold it); NANGUARD_CURVE_SECRET_KEY, to encrypt the ranks' link with CurveZMQ (nanguard "
    "keys makes a pair)")
_OPERATOR_ENVIRONMENT = ("environment: NANGUARD_COORDINATOR (the address), NANGUARD_TOKEN and "
                         "NANGUARD_OPERATOR_TOKEN as the coordinator has them, NANGUARD_CURVE_PUBLIC_KEY "
                         "if it uses CurveZMQ")


def _operator_commands(commands, loopback: str) -> None:
    for name, func, text in (("status", _status, "show the ranks and the stop state of a job"),
                             ("stop", _stop, "stop every rank of a job at one common step"),
                             ("clear", _clear, "lift a job's standing stop, so that its restarts and "
                                               "launches run")):
        verb = commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                                   epilog=_OPERATOR_ENVIRONMENT)
        verb.add_argument("--coordinator", help="coordinator address (default: $NANGUARD_COORDINATOR, else "
                                                f"{loopback}, where nanguard coordinator listens by default)")
        verb.add_argument("--timeout-s", type=float, default=5.0,
                          help="give up after this many seconds without an answer (default %(default)s)")
        verb.set_defaults(func=func, loopback=loopback)
        if name == "status":
            verb.add_argument("--json", action="store_true", help="print the reply as JSON")
        else:
            verb.add_argument("--reason", required=True, help="why: in the coordinator's log" + (
                "" if name == "clear" else " and shown to every rank"))


def main(argv: list[str] | None = None) -> int:
    from ._version import __version__

    parser = argparse.ArgumentParser(prog="nanguard", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"nanguard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a coordinator and a 2-rank torchrun job that goes non-finite,"
                                            " its metrics, its incident and the replay verdict")
    demo.add_argument("--steps", type=int, default=40, help="training steps to run")
    demo.add_argument("--bad-step", type=int, default=25, help="step at which a layer overflows")
    demo.add_argument("--dir", default="nanguard-demo",
                      help="folder for the incident and the coordinator's log (default %(default)s)")
    demo.set_defaults(func=_demo)
    coordinator = commands.add_parser("coordinator", help="run the coordinator daemon beside a job",
                                      description="Run the coordinator daemon beside a job, until SIGTERM "
                                                  "or SIGINT.", epilog=_COORDINATOR_ENVIRONMENT)
    from .coordinator.main import add_arguments

    add_arguments(coordinator)
    coordinator.set_defaults(func=_coordinator)
    _operator_commands(commands, coordinator.get_default("bind"))
    keys = commands.add_parser("keys", help="print a new CurveZMQ key pair for the coordinator (optional "
                                             "encryption of the ranks' link)")
    keys.set_defaults(func=_keys)
    # listed here for --help; its own parser (nanguard/incident/inspection.py) reads its arguments
    commands.add_parser("inspect", add_help=False,
                        help="summarise an incident folder: nanguard inspect DIR [--json] [--plot FILE.png]")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["inspect"]:
        from .incident.inspection import main as inspect_main

        return inspect_main(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
