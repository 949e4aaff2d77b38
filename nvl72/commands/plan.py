"""`nvl72 plan`: print the deployment of prefill and decode instances for a rack, a model and token rates."""
from __future__ import annotations

import argparse

from nvl72.cli import NotAvailableYet

HELP = "print the deployment of prefill and decode instances for a rack, a model and token rates"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet("nvl72 plan")
