"""Benchmarks that measure and print figures (not pass/fail timing tests)."""

from trace_rl import environ as _environ

_environ.apply()  # before any prefect import (trace_rl/environ.py says why)
