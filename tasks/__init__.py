"""Thin Prefect tasks, one per phase of a TRACE step (docs/architecture.md).

Each task loads what it needs by reference (work dir, run id, step, config), calls trace_core or an
engine, stores, and returns ids or Arrow tables. Cache keys: ``runtime.PHASE_KEY``.
"""

from trace_rl import environ as _environ

_environ.apply()  # before any prefect import (trace_rl/environ.py says why)
