#!/usr/bin/env bash
# On the 2-GPU machine (nvidia-h200-x2), issue #12: NCCL exactness of the decode graphs and of the eager path
# ("exact"); the concurrency bench (prefill TTFT and decode tok/s per stream, "concurrency") and the decode and
# prefill benches ("serve") with expert parallel and tensor parallel against one GPU, on the 4-of-48-layer
# Qwen3-Next bf16 checkpoint. PARTS picks them (default: all three, more than one 10-minute device call: split
# them). Carry .whl/. Each step has its own time limit, so one that hangs (the scripts print every rank's stack
# first) cannot take the others' time.
#
#   PARTS=exact bash scripts/gpu_parallel_bench.sh         # at most ~6 minutes (GRAPHS_ONLY=1: ~3.5, the graphs)
#   PARTS=concurrency bash scripts/gpu_parallel_bench.sh   # ~8 minutes on a fresh machine (synthesis included)
#   PARTS=serve bash scripts/gpu_parallel_bench.sh         # ~8 minutes on a fresh machine
# Exits 1 when a check or a bench failed or ran out of its limit.
# Results JSON and logs in $OUT (or /tmp/gpu_parallel).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh   # .whl, PYTHONPATH, the Triton cache (carry .whl and .tcache)
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/gpu_parallel}
ckpt=${CKPT:-/tmp/q3n4}
mkdir -p "$out"
nvidia-smi -L
parts=" ${PARTS:-exact concurrency serve} "
# the checkpoint (~90 s), in the background while the exactness scripts run (which synthesise their own)
[[ $parts == " exact " ]] || [ -f "$ckpt/tokenizer.json" ] || (python3 -m flashnext.cli synth --preset qwen3-next-80b \
  --dtype bf16 --layers 4 --out "$ckpt" > "$out/synth.log" 2>&1 &)
cleanup() {  # a step cut by its limit leaves its rank processes (and a bench its server) holding the GPUs
  pkill -9 -f "flashnext.cli serve" || true
  pkill -9 -f "multiprocessing.spawn" || true
  sleep 2
}
failed=()
if [[ $parts == *" exact "* ]]; then
  # fresh machine: most of these limits is compiling the Triton kernels (and fla's) for fp32
  HANG_S=180 timeout 200 python3 scripts/gpu_parallel_graphs.py 2>&1 | grep -v "Loading weights" | tee "$out/graphs.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=(graphs)
  cleanup
  if [ -z "${GRAPHS_ONLY:-}" ]; then
    timeout 170 python3 scripts/gpu_parallel.py --dtype float32 --hang-s 150 2>&1 | grep -v "Loading weights" \
      > "$out/parallel_fp32.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=(parallel_fp32)
    tail -20 "$out/parallel_fp32.txt"
    cleanup
  fi
fi
finish() {
  if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; exit 1; fi
  echo "ALL PASSED"; exit 0
}
[[ $parts == " exact " ]] && finish
for _ in $(seq 60); do [ -f "$ckpt/tokenizer.json" ] && break; sleep 2; done; sleep 2   # the tokenizer is written last
layouts() {  # layouts BENCH_ARGS...: one server per layout, each with its limit (startup is most of it)
  echo "== one GPU";           CUDA_VISIBLE_DEVICES=0 bench 120 "--kv-cache-gb 8" "$@"
  echo "== tensor parallel 2"; bench 110 "--tensor-parallel 2 --kv-cache-gb 8" "$@"
  echo "== expert parallel 2"; bench 120 "--expert-parallel 2 --kv-cache-gb 8" "$@"
}
bench() {  # bench LIMIT_S SERVER_ARGS BENCH_ARGS...
  local limit=$1 server_args=$2; shift 2
  # no --floor: the floors are for the 48-layer models, not this 4-layer cut
  timeout "$limit" python3 -m flashnext.bench "$@" --model "$ckpt" --out-dir "$out" --no-plots \
    --server-args "$server_args" 2>&1 | grep -v "^wrote" | tail -24
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$1 ${server_args%% *}")
  cleanup
}
if [[ $parts == *" concurrency "* ]]; then
  layouts concurrency --streams 1,2,4 --prompt-tokens 4096 --gen-tokens 128
fi
if [[ $parts == *" serve "* ]]; then
  layouts all --only decode,prefill --depths 0,10000 --lengths 10000 --warmups 1 --runs 3 --max-tokens 128
fi
finish
