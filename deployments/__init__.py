"""How TRACE's flows are deployed, scheduled and pooled on a Prefect server (docs/deployments.md):
``python -m deployments.deploy`` creates the process work pools and registers the deployments."""

from trace_rl import environ as _environ

_environ.apply()  # before any prefect import (trace_rl/environ.py says why)
