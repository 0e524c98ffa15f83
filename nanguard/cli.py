"""The ``nanguard`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(steps=args.steps, bad_step=args.bad_step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanguard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model that goes NaN and show the report")
    demo.add_argument("--steps", type=int, default=40, help="training steps to run")
    demo.add_argument("--bad-step", type=int, default=25, help="step at which a layer produces a NaN")
    demo.set_defaults(func=_demo)
    # listed here for --help; its own parser (nanguard/inspect.py) reads its arguments
    commands.add_parser("inspect", add_help=False,
                        help="summarise an incident folder: nanguard inspect DIR [--json]")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["inspect"]:
        from .inspect import main as inspect_main

        return inspect_main(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
