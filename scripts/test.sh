#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
# Two workers (pytest-xdist; tests/conftest.py keeps the sandbox and Ray tests each on one worker).
# TRACE_TEST_WORKERS=0 runs everything in this process, one test after another.
exec .venv/bin/python -m pytest -q -n "${TRACE_TEST_WORKERS:-2}" --dist loadgroup "$@"
