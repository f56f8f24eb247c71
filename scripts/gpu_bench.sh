#!/usr/bin/env bash
# PERF.md's benchmarks on the GPU machine (no network): synthesise the full-size checkpoint, serve it with our
# server, run the chosen benchmarks, keep the results in bench/results/ (and in $OUT when set).
#
#   scripts/gpu_bench.sh                    # every benchmark, full protocol, one server
#   scripts/gpu_bench.sh decode prefill     # some of them (each starts the server anew: load time each)
#   QUICK=1 scripts/gpu_bench.sh all        # small sizes: a smoke run that fits a 10-minute slot
#
# Settings (environment):
#   PRESET=flash-next  DTYPE=int4       what `flashnext synth` makes
#   CKPT=/tmp/flashnext-$PRESET-$DTYPE  where the checkpoint goes (reused when it has a config.json);
#                                       CKPT=mem:flash-next builds random weights in memory instead (no disk;
#                                       add SERVER_ARGS="--quantize int4" for the INT4 release's layout)
#   LAYERS=N                            synthesise only N layers (a smaller, faster checkpoint)
#   SERVER_ARGS="..."                   extra `flashnext serve` flags for every run
#   BENCH_ARGS="..."                    extra `flashnext bench` flags (e.g. "--runs 3 --depths 0,10000,65536")
#   HOST_TIER_ARGS="..."                when set, idle runs a second time with these server flags (host-RAM KV tier)
#   DISK_TIER_ARGS="..."                when set, idle runs again with these server flags and --restart (disk tier,
#                                       e.g. "--kv-disk-dir /tmp/flashnext-kv --kv-host-write-through true")
#   EXPERT_BUDGET_ARGS="..."            when set, experts runs a second time with these server flags (VRAM budget)
#   OUT_DIR=bench/results  OUT=...      results folder; $OUT (the device machine's return folder) gets
#                                       bench-results.tgz of it and report.md
#   FLASHNEXT_COMMIT=<sha>              the commit the results name, where this tree has no .git
#   PYTHON=python3
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PRESET=${PRESET:-flash-next}
DTYPE=${DTYPE:-int4}
CKPT=${CKPT:-/tmp/flashnext-$PRESET-$DTYPE}
OUT_DIR=${OUT_DIR:-bench/results}
BENCHES=("$@")
[ ${#BENCHES[@]} -gt 0 ] || BENCHES=(all)

# 1. Imports. The machine has no network: wheels travel in .whl/ and install from there.
declare -A WHEEL=([torch]=torch [safetensors]=safetensors [tokenizers]=tokenizers [jinja2]=jinja2
                  [fastapi]=fastapi [uvicorn]=uvicorn [pydantic]=pydantic [prometheus_client]=prometheus-client
                  [httpx]=httpx [xgrammar]=xgrammar [tvm_ffi]=apache-tvm-ffi [matplotlib]=matplotlib)
missing() { for m in "${!WHEEL[@]}"; do "$PY" -c "import $m" 2>/dev/null || echo "${WHEEL[$m]}"; done; }
need=$(missing)
if [ -n "$need" ] && [ -d .whl ]; then
  echo "installing from .whl/: $need"
  # shellcheck disable=SC2086
  "$PY" -m pip install --quiet --no-index --find-links .whl $need || true
  need=$(missing)
fi
if echo "$need" | grep -qx matplotlib; then
  echo "matplotlib missing: no plots (carry its wheel in .whl/ to get them)"
  BENCH_ARGS="${BENCH_ARGS:-} --no-plots"
  need=$(echo "$need" | grep -vx matplotlib || true)
fi
if [ -n "$need" ]; then
  pyver=$("$PY" -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')
  echo "missing on this machine: $(echo $need)"
  echo "carry their wheels (and dependencies) in .whl/, made on a machine with network, e.g.:"
  echo "  pip download --only-binary=:all: --python-version $pyver --platform manylinux2014_x86_64 -d .whl $(echo $need)"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi: results will say cpu"

# A FLASHNEXT_COMMIT that is no commit would stop the bench after the checkpoint's minutes: stop before them.
"$PY" -c "from flashnext.bench.results import commit_from_env; commit_from_env()"

# 2. The checkpoint: random weights of the released config, in the released quantisation. Check the disk
# first: a synthesis that fills it fails only after minutes (flash-next's bf16 PLE table alone is ~102 GB).
if [[ "$CKPT" != mem:* ]] && [ ! -f "$CKPT/config.json" ]; then
  need_gb=$("$PY" - "$PRESET" "$DTYPE" "${LAYERS:-}" <<'PY'
import math, sys
from flashnext.weights.presets import get_preset, set_num_layers
from flashnext.weights.synth import expected_tensors, is_quantised
preset, dtype, layers = sys.argv[1:4]
config = get_preset(preset)
if layers:
    set_num_layers(config, int(layers))
quantised = {"int4": 0.53, "fp8": 1.0, "bf16": 2.0}[dtype]  # bytes per parameter, scales included
total = sum(math.prod(shape) * (quantised if is_quantised(name) else 2.0)
            for name, (shape, _) in expected_tensors(config).items())
print(math.ceil(total / 1e9))
PY
)
  mkdir -p "$(dirname "$CKPT")"
  free_gb=$(df -B1000000000 --output=avail "$(dirname "$CKPT")" | tail -1 | tr -d ' ')
  echo "synthesising $PRESET ($DTYPE${LAYERS:+, $LAYERS layers}) into $CKPT: ~$need_gb GB, $free_gb GB free"
  if [ "$need_gb" -gt "$free_gb" ]; then
    echo "not enough disk: point CKPT at a larger volume, use a smaller PRESET, or fewer LAYERS"
    exit 3
  fi
  t0=$SECONDS
  "$PY" -m flashnext.cli synth --preset "$PRESET" --dtype "$DTYPE" --out "$CKPT" ${LAYERS:+--layers "$LAYERS"}
  echo "synthesised in $((SECONDS - t0)) s: $(du -sh "$CKPT" | cut -f1)"
fi

# 3. The benchmarks. Each run writes its JSON as soon as it ends, and $OUT gets a copy after each, so a
# run cut short by a time limit still returns what finished.
if [ -n "${QUICK:-}" ]; then
  BENCH_ARGS="--max-tokens 128 --warmups 1 --runs 2 --depths 0,10000 --lengths 10000 --scale 0.3 \
--conversations 2 --conv-tokens 8000 --churn-tokens 16000 --streams 1,2,4 --prompt-tokens 8000 ${BENCH_ARGS:-}"
fi
STARTED=$(mktemp)   # the report covers the results files this run writes (the folder also holds scripts' outputs)
# One archive (the device machine returns only a few files), plus the report when there is one.
copy_out() {
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/bench-results.tgz" -C "$OUT_DIR" .
    if [ -f "$OUT_DIR/report.md" ]; then cp "$OUT_DIR/report.md" "$OUT/"; fi
  fi
}
bench() {  # bench NAME SERVER_ARGS
  echo "== flashnext bench $1 (server args: ${2:-none})"
  # shellcheck disable=SC2086
  "$PY" -m flashnext.bench "$1" --model "$CKPT" --server-args "$2" --out-dir "$OUT_DIR" --floor "$PRESET" \
    ${BENCH_ARGS:-} || echo "bench $1 failed (status $?); going on"
  copy_out
}
for name in "${BENCHES[@]}"; do
  bench "$name" "${SERVER_ARGS:-}"
  if [ -n "${HOST_TIER_ARGS:-}" ] && { [ "$name" = idle ] || [ "$name" = all ]; }; then
    bench idle "${SERVER_ARGS:-} $HOST_TIER_ARGS"
  fi
  if [ -n "${DISK_TIER_ARGS:-}" ] && { [ "$name" = idle ] || [ "$name" = all ]; }; then
    FLASHNEXT_BENCH_RESTART=1 bench idle "${SERVER_ARGS:-} $DISK_TIER_ARGS"
  fi
  if [ -n "${EXPERT_BUDGET_ARGS:-}" ] && { [ "$name" = experts ] || [ "$name" = all ]; }; then
    bench experts "${SERVER_ARGS:-} $EXPERT_BUDGET_ARGS"
  fi
done
mapfile -t written < <(find "$OUT_DIR" -maxdepth 1 -name '*.json' -newer "$STARTED" | sort)
rm -f "$STARTED"
if [ ${#written[@]} -gt 0 ]; then
  "$PY" -m flashnext.bench report "${written[@]}" --out "$OUT_DIR/report.md" && cat "$OUT_DIR/report.md"
fi
copy_out
