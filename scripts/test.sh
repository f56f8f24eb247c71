#!/usr/bin/env bash
# Installs the test dependencies (transformers pinned as the oracle) and runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh "[test,bench]"
# Keep fla-core and causal-conv1d out of the oracle's environment: transformers would use them and they
# do not run on CPU (MODEL.md §4).
python3 -m pip uninstall -y -q fla-core flash-linear-attention causal-conv1d 2>/dev/null || true
# Tiny test models run fastest on one thread per process (the server and bench tests start several).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export FLASHNEXT_CACHE="${FLASHNEXT_CACHE:-$(mktemp -d)}"
exec python3 -m pytest -p no:cacheprovider tests "$@"
