"""Independent parts of a decode step as parallel branches of its CUDA graph (FLASHNEXT_DECODE_BRANCHES=1).

A batch-1 decode step is ~1,400 kernels, each too small to fill the H200 (BENCHMARKS.md: the GEMVs run at
15–30% of bandwidth, latency-bound). Parts that share only their input can run at the same time: the three
projections of GatedDeltaNet's input, the shared expert beside the routed experts, QSA's token selection beside
the attention projections. `parallel(x, f, g, …)` runs f on the current stream and each other function on a
side stream forked from it, then joins them; captured, the graph holds them as concurrent branches. Each branch counts its split-K kernels on its own arrival
counters (ops/arrival.py lanes). Outputs made on a side stream are recorded on the current one, so the
allocator does not hand their memory to the side stream's next work while the current stream still reads it.

Off by default until the H200 decode profile (`FLASHNEXT_DECODE_BRANCHES=1 python3 scripts/gpu_decode.py`)
shows the gain and `gpu_decode.py --fp32-only` the same tokens; on CPU, and when off, the functions run one
after another on the current stream.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

_SIDE_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


DECODE_MAX_ROWS = 64   # larger inputs (prefill chunks) fill the GPU alone: their parts run one after another


def enabled(x: torch.Tensor) -> bool:
    return (x.is_cuda and x.shape[0] <= DECODE_MAX_ROWS
            and os.environ.get("FLASHNEXT_DECODE_BRANCHES", "0") == "1")


def _side_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    key = (device, lane)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[key]


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def parallel(x: torch.Tensor, *fns: Callable[[], object]) -> tuple:
    """(fns[0](), fns[1](), …); `x` (an input of them all) names the device."""
    if not enabled(x):
        return tuple(f() for f in fns)
    # Here, not at the top: the model files import this module, and Triton is only a test extra (a CPU install
    # has none); this line runs only with CUDA side streams.
    from flashnext.ops.arrival import in_lane

    main = torch.cuda.current_stream(x.device)
    results: list[object] = [None] * len(fns)
    sides = []
    for lane, fn in enumerate(fns[1:], start=1):
        side = _side_stream(x.device, lane)
        side.wait_stream(main)
        with torch.cuda.stream(side), in_lane(lane):
            results[lane] = fn()
        sides.append(side)
    results[0] = fns[0]()
    for side in sides:
        main.wait_stream(side)
    for result in results[1:]:
        for t in _tensors(result):
            t.record_stream(main)
    return tuple(results)
