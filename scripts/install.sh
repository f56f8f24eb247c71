#!/usr/bin/env bash
# Installs flashnext into the current Python. On a machine without a CUDA torch it first installs the
# CPU wheel of torch 2.13.0 (a bare `torch` requirement would pull a multi-GB CUDA build); where torch is
# already installed (the GPU machine's 2.11 + Triton 3.6) it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".${1:-}"
