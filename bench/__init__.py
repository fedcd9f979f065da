"""Benchmarks that measure and print figures (not pass/fail timing tests); their records, which
let seeds accumulate across invocations and machines, are in ``RECORDS`` (results/README.md)."""

from argparse import ArgumentParser
from pathlib import Path

from trace_rl import environ as _environ

_environ.apply()  # before any prefect import (trace_rl/environ.py says why)

RECORDS = Path(__file__).resolve().parents[1] / "results"
"""The records folder: one file per benchmark, method and seed."""


def add_options(ap: ArgumentParser, *rows: tuple) -> None:
    """Options from ``(flag, default, help)`` rows: the type is the default's, and a bare type
    (``int``) stands for an option of that type that defaults to None."""
    for flag, default, help in rows:
        bare = isinstance(default, type)
        ap.add_argument(flag, type=default if bare else type(default), default=None if bare else default,
                        help=help or None)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table of ``rows`` (cells as printed) under ``head``."""
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return "\n".join([line(head), "|---" * len(head) + "|", *map(line, rows)])
