#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
