# Sourced by the GPU scripts: keep Triton's compiled kernels and autotuning results from one device call to
# the next. Every device call may start a fresh machine, whose empty cache cost 60–180 s per call in session 5
# (the server's first start took 81 s; fla's fp32 chunk kernels autotuned past a 180 s limit).
#
# Restores .tcache/triton.tar.gz.* (carry `.tcache`) into TRITON_CACHE_DIR, turns on the autotuner's disk
# cache, and at exit writes the cache back to $OUT as at most three pieces of 15 MiB (files from $OUT come
# back 16 MiB each), without the intermediate IRs (a cached kernel loads from its .json, .cubin and .ptx; the group file lists
# the others, but Triton's cache only returns the files that exist).
# Here, after the call: `rm -rf .tcache && mkdir .tcache && cp <files_at>/triton.tar.gz.* .tcache/` (git-ignored;
# a stale piece of an earlier save would corrupt the stream).
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G ".tcache/triton.tar.gz.*" >/dev/null; then
  cat .tcache/triton.tar.gz.* | tar -xzf - -C "$TRITON_CACHE_DIR" && \
    echo "triton cache: restored $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels"
fi
save_triton_cache() {
  [ -n "${OUT:-}" ] || return 0
  local tmp
  tmp=$(mktemp -d)
  tar -czf "$tmp/triton.tar.gz" -C "$TRITON_CACHE_DIR" --exclude='*.llir' --exclude='*.ttir' --exclude='*.ttgir' \
    --exclude='*.source' . 2>/dev/null
  local size
  size=$(stat -c %s "$tmp/triton.tar.gz")
  local pieces=$(( (size + (15 << 20) - 1) / (15 << 20) )) held
  held=$(find "$OUT" -type f | wc -l)
  if [ $((held + pieces)) -gt 8 ]; then   # a call brings back 8 files at most: the results come first
    echo "triton cache: $((size >> 20)) MiB in $pieces pieces would pass the 8 files \$OUT brings back; not saved"
  elif [ "$size" -le $((45 << 20)) ]; then
    split -b 15m -d "$tmp/triton.tar.gz" "$OUT/triton.tar.gz."
    echo "triton cache: saved $((size >> 20)) MiB to \$OUT"
  else
    echo "triton cache: $((size >> 20)) MiB, too large to bring back; not saved"
  fi
  rm -rf "$tmp"
}
trap save_triton_cache EXIT
