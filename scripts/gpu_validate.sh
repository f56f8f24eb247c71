#!/usr/bin/env bash
# On the GPU machine, one call: every kernel against its reference in bf16, the decode graph against eager
# (fp32 tokens), the full-size decode step timed and profiled, and the decode benchmark through the server.
# Writes each part's output under $OUT (when set) and exits non-zero if any check failed.
#
#   SKIP_BENCH=1 bash scripts/gpu_validate.sh   # the checks and the step profile, ~6 minutes (carry .whl/)
#   ONLY_BENCH=1 bash scripts/gpu_validate.sh   # the decode bench of both models, ~4 minutes (a second call:
#                                               # one device call may run 10 minutes at most)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 FLASHNEXT_CACHE=${FLASHNEXT_CACHE:-/tmp/fncache}
out=${OUT:-/tmp/gpu_validate}
mkdir -p "$out"
failed=()
part() {  # part NAME COMMAND...
  local name=$1; shift
  echo "=== $name: $*"
  if ! timeout 300 "$@" 2>&1 | grep -v "Warning\|warn_once\|Loading weights" | tee "$out/$name.txt"; then
    failed+=("$name")
  fi
}
if [ -z "${ONLY_BENCH:-}" ]; then
  part small_ops python3 scripts/gpu_small_ops.py
  part gdn python3 scripts/gpu_gdn_decode.py
  part attention python3 scripts/gpu_decode_attention.py
  part hc python3 scripts/gpu_hyper_connection.py
  part moe python3 scripts/gpu_moe.py --quick
  part w4a16 python3 scripts/gpu_w4a16.py --quick
  part sparse_prefill python3 scripts/gpu_sparse_prefill.py
  part gdn_prefill python3 scripts/gpu_gdn_prefill.py
  part decode python3 scripts/gpu_decode.py --fp32-only --model mem:flash-next --quantize int4
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  for m in flash-next qwen3-next-80b; do
    part "bench-$m" python3 -m flashnext.bench decode --model "mem:$m" --server-args "--quantize int4 --kv-cache-gb 16 \
--max-num-seqs 4" --depths 0,10000 --warmups 1 --runs 3 --max-tokens 256 --floor "$m" --out-dir "$out" --no-plots
  done
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "ALL PASSED"
