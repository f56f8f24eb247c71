"""Arrival counters: how a split-K Triton kernel sums its partials in one launch, in a fixed order.

Every program of a tile writes its fp32 partial, then counts itself in on the tile's counter; the last to
arrive adds the partials in split order, writes the result and resets the counter to zero. So there is no
memset before a launch, no second launch and no fp32 atomics on values (results are the same bits run to run).
Since every launch leaves its counters at zero, one buffer per device serves every such kernel — one launch at
a time, which holds on the single stream of a decode step. The parallel branches of ops/branches.py run beside
it on side streams: each branch ("lane") counts on a buffer of its own. Lanes, not streams, key the buffers, so
that the eager warm-up before a capture has created every buffer the capture will use.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

_BUFFERS: dict[tuple[torch.device, int], list[torch.Tensor]] = {}    # (device, lane) → buffers
MIN_COUNTERS = 1 << 16
_lane = threading.local()


@contextlib.contextmanager
def in_lane(lane: int):
    """Kernels launched inside count on lane `lane`'s buffers (0: the decode step's own stream)."""
    before = getattr(_lane, "value", 0)
    _lane.value = lane
    try:
        yield
    finally:
        _lane.value = before


def buffers(device: torch.device) -> list[torch.Tensor]:
    """Every counter buffer of `device`, of all lanes (tests check that launches leave them zeroed)."""
    return [b for (d, _), bufs in _BUFFERS.items() if d == device for b in bufs]


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on `device`, for kernels launched in the current lane.

    An outgrown buffer stays alive (a captured graph may still point at it). Never grown during CUDA-graph
    capture: a capture that needs more gets a buffer of its own, zeroed by a memset recorded in the graph (the
    cache must not hold memory that the graph's pool may hand out again)."""
    held = _BUFFERS.setdefault((device, getattr(_lane, "value", 0)), [])
    if held and held[-1].numel() >= n:
        return held[-1]
    buf = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        held.append(buf)
    return buf


@triton.jit
def arrive_last(counter_ptr, count):
    """Count this program in on its counter; True for the last of `count`, which resets the counter to 0.

    The barrier puts every thread's partial stores before the (release) atomic of the thread doing it; the
    last program's (acquire) atomic then sees all of them, and it reads them past L1 (.cg)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == count - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
