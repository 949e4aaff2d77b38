"""`nvl72 bench`: benchmark a running server (fixed lengths and the agentic workload)."""
from __future__ import annotations

import argparse

from nvl72.cli import NotAvailableYet

HELP = "benchmark a running server (fixed lengths and the agentic workload)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet("nvl72 bench")
