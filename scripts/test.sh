#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
# The browser tests' chromium (Debian's, as root), installed once here rather than by whichever
# worker reaches a browser test first; where it cannot be, those tests skip saying why (and fail
# with TRACE_REQUIRE_BROWSER=1, as in .ci/run).
.venv/bin/python tests/browser.py
# Two workers (pytest-xdist; each has its own temporary root, see tests/conftest.py).
# TRACE_TEST_WORKERS=0 runs everything in this process, one test after another.
exec .venv/bin/python -m pytest -q -n "${TRACE_TEST_WORKERS:-2}" "$@"
