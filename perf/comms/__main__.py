"""`python -m perf.comms allreduce|dispatch ...`: nccl-tests-style comms benchmarks (JSON out)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

BENCHES = {"allreduce": "perf.comms.allreduce", "dispatch": "perf.comms.dispatch"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.comms", description=__doc__)
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name, modname in BENCHES.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            continue  # that benchmark is not written yet
        p = sub.add_parser(name, help=(mod.__doc__ or name).strip().split("\n")[0])
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.bench is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
