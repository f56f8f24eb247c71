# Sourced by the GPU scripts (gpu_validate.sh, gpu_parallel_bench.sh) from the repository root: the wheels
# carried in .whl/ installed into /tmp/site, the repo on PYTHONPATH, unbuffered output, and Triton's cache
# carried between device calls (gpu_triton_cache.sh; carry .tcache too).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
source scripts/gpu_triton_cache.sh
