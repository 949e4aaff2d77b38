"""`nvl72 kernels`: build or list the ahead-of-time kernel bundle."""
from __future__ import annotations

import argparse

from nvl72.cli import NotAvailableYet

HELP = "build or list the ahead-of-time kernel bundle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet("nvl72 kernels")
