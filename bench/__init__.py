"""Benchmarks that measure and print figures (not pass/fail timing tests). The records that let
seeds accumulate across invocations and machines live outside the package, in ``RECORDS``
(results/README.md: the layout)."""

from pathlib import Path

from trace_rl import environ as _environ

_environ.apply()  # before any prefect import (trace_rl/environ.py says why)

RECORDS = Path(__file__).resolve().parents[1] / "results"
"""The records folder: one file per benchmark, method and seed."""
