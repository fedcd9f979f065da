"""One-off studies and analyses of stored runs: each answered a question whose finding is recorded
in docs/results.md (or the history it links to). Run from the repository root (``python -m studies.<name>``);
not installed with the package. The benchmarks behind the README's claims are in ``bench/``."""

from trace_rl import environ as _environ

_environ.apply()  # before any prefect import (trace_rl/environ.py says why)
