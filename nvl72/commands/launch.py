"""`nvl72 launch`: start this rank's role under srun/mpirun (one process per GPU)."""
from __future__ import annotations

import argparse

from nvl72.cli import NotAvailableYet

HELP = "start this rank's role under srun/mpirun (one process per GPU)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet("nvl72 launch")
