"""`nvl72 serve`: start the OpenAI-compatible HTTP server (embedded tiny default model if --model is not given)."""
from __future__ import annotations

import argparse

from nvl72.cli import NotAvailableYet

HELP = "start the OpenAI-compatible HTTP server (embedded tiny default model if --model is not given)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet("nvl72 serve")
