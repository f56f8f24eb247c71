#!/usr/bin/env bash
# On the GPU machine: every kernel against its reference in bf16 — "checks"; the decode graph against eager and
# the CPU reference (fp32 tokens), chunked and sparse prefill, fla's GDN prefill — "exact"; the full-size decode
# step and prefill timed and profiled by kernel, and the INT4 GEMM sweep — "profile"; the switches still off
# (decode branches, dequantised prefill GEMMs) checked and timed the same way — "variants"; the decode benchmark
# of both models through the server — "bench". PARTS picks them (default: all five; one device call may run 10
# minutes at most, so give each its own call). Carry .whl/ and .tcache/. Times are for a warm Triton cache;
# a fresh machine compiles for 1–3 minutes more.
# Writes every part's output to $OUT/validate.txt (when set) and exits non-zero if any check failed.
#
#   PARTS=checks bash scripts/gpu_validate.sh    # ~5 minutes
#   PARTS=exact bash scripts/gpu_validate.sh     # ~4 minutes
#   PARTS=profile bash scripts/gpu_validate.sh   # ~8 minutes (the INT4 GEMM sweep is ~3)
#   PARTS=variants bash scripts/gpu_validate.sh  # ~8 minutes (not measured yet)
#   PARTS=bench bash scripts/gpu_validate.sh     # ~4 minutes
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh   # .whl, PYTHONPATH, the Triton cache (carry .whl and .tcache)
export FLASHNEXT_CACHE=${FLASHNEXT_CACHE:-/tmp/fncache}
out=${OUT:-/tmp/gpu_validate}
mkdir -p "$out"
failed=()
part() {  # part NAME COMMAND...
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$out/validate.txt"
  # one log for all parts: a call brings back 8 files, and the Triton cache's pieces must fit beside the results
  if ! timeout 300 "$@" 2>&1 | grep -v "Warning\|warn_once\|Loading weights" | tee -a "$out/validate.txt"; then
    failed+=("$name")
  fi
}
parts=" ${PARTS:-checks exact profile variants bench} "
if [[ $parts == *" checks "* ]]; then
  part small_ops python3 scripts/gpu_small_ops.py
  part gdn python3 scripts/gpu_gdn_decode.py
  part attention python3 scripts/gpu_decode_attention.py
  part hc python3 scripts/gpu_hyper_connection.py
  part moe python3 scripts/gpu_moe.py --quick
  part w4a16 python3 scripts/gpu_w4a16.py --quick
  part tinygemm python3 scripts/gpu_tinygemm.py   # the bf16 decode path of the dense INT4 weights
  part prefill_attention python3 scripts/gpu_prefill_attention.py
fi
if [[ $parts == *" exact "* ]]; then
  part sparse_prefill python3 scripts/gpu_sparse_prefill.py
  part gdn_prefill python3 scripts/gpu_gdn_prefill.py
  part decode python3 scripts/gpu_decode.py --fp32-only
  part expert_cache python3 scripts/gpu_expert_cache.py
fi
if [[ $parts == *" profile "* ]]; then
  part decode_step python3 scripts/gpu_decode.py --skip-exactness --model mem:flash-next --quantize int4
  part host python3 scripts/gpu_host_profile.py   # the engine loop's host time per token, by part
  part prefill_gemm python3 scripts/gpu_prefill_gemm.py --m 8192
  part prefill python3 scripts/gpu_prefill.py --model mem:flash-next --quantize int4 --tokens 10000 --chunk 2048 --chunk 8192
fi
if [[ $parts == *" variants "* ]]; then   # the switches that are off until measured, against "profile"'s numbers
  # the projections of one input and the shared expert as parallel graph branches (ops/branches.py)
  part decode_branches env FLASHNEXT_DECODE_BRANCHES=1 python3 scripts/gpu_decode.py --fp32-only
  part decode_step_branches env FLASHNEXT_DECODE_BRANCHES=1 python3 scripts/gpu_decode.py --skip-exactness \
    --model mem:flash-next --quantize int4
  # the routed experts' prefill through the grouped kernels against dequantised weights and torch's grouped GEMM
  # (docs/int4.md; the default from ~100 rows an expert; scripts/gpu_moe.py --prefill times the MoE alone)
  part prefill_moe_kernels python3 scripts/gpu_prefill.py --model mem:flash-next --quantize int4 --tokens 10000 \
    --chunk 16384 --no-profile --variant FLASHNEXT_MOE_PREFILL=triton
fi
if [[ $parts == *" bench "* ]]; then
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
