"""The `nvl72` console entry. Each subcommand lives in `nvl72/commands/<name>.py` and defines
`HELP`, `add_arguments(parser)` and `run(args) -> int`; this file only wires them together."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = ("serve", "plan", "launch", "kernels", "bench")


class CLIError(Exception):
    """A user-facing error: printed as one line naming the bad value, exit code 2."""


class NotAvailableYet(CLIError):
    def __init__(self, what: str):
        super().__init__(f"'{what}' is not available yet in this build of nvl72")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvl72", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f"nvl72.commands.{name}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        parser.error(f"--log-level: unknown level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except CLIError as e:
        print(f"nvl72 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
