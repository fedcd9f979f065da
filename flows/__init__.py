"""Prefect flows: the control loop of TRACE, as named phases (docs/architecture.md)."""

from trace_rl import environ as _environ

_environ.apply()  # before any prefect import (trace_rl/environ.py says why)
