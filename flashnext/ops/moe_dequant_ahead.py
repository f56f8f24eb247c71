"""A layer's experts dequantised on a side stream while the layer's token mixer runs, for the MoE prefill path through
dequantised experts (ops/moe_int4_dequant.py).

That path dequantises all of a layer's experts at every prefill step: on the H200, Flash-Next, 1.59 ms a layer of
the 4.2 ms its MoE takes at 10K tokens, 77 ms of a 10K prompt's 535 ms (BENCHMARKS.md session 18) — bandwidth-bound
work that waits for nothing but the weights, beside a token mixer of GEMMs and the GatedDeltaNet kernels (~7 ms a
layer at 10K). So when a layer's MoE has been queued, `start` queues the next layer's dequantisation on a stream of
its own, after an event that says the MoE before it is done with the scratch; the next MoE's `take` waits for it on
the compute stream. One scratch holds both stacks (gate|up and down: Flash-Next 5.0 GB, against 3.4 GB for the
larger of the two without this), kept for the engine's life once a step has needed it. The results are the path's
own bit for bit: the same kernels, the same inputs, only the order in which the streams run them changes.

Off the GPU there is no second stream: `start` does nothing and `take` dequantises in place. FLASHNEXT_MOE_DEQUANT_AHEAD=1 turns it on (read at each step: a script can time both); off by default until the H200
has timed it (scripts/gpu_prefill.py --variant FLASHNEXT_MOE_DEQUANT_AHEAD=1 --compare).
"""
from __future__ import annotations

import os

import torch

from flashnext.ops.int4_dequant_triton import dequantize_triton
from flashnext.weights.int4_layout import Int4Weight


def enabled() -> bool:
    return os.environ.get("FLASHNEXT_MOE_DEQUANT_AHEAD", "0") == "1"


class DequantAhead:
    """The scratch and the side stream that a chain of owners share (a model's Int4Experts in layer order,
    models/layers/int4_experts.py). Not for a step being captured into a CUDA graph (the scratch would be written at
    the graph's replays)."""

    def __init__(self, chain=()):
        self.chain = list(chain)
        self._position = {id(owner): i for i, owner in enumerate(self.chain)}
        self.scratch: tuple[torch.Tensor, torch.Tensor] | None = None   # gate|up [E, H, 2I] and down [E, I, H]
        self.holds: object | None = None       # whose experts the scratch holds (or will, once `ready` has passed)
        self.ready: torch.cuda.Event | None = None   # recorded on the side stream after the last `start`'s work
        self.stream: torch.cuda.Stream | None = None

    def following(self, owner: object) -> object | None:
        """The owner after `owner` in the chain, or None."""
        i = self._position[id(owner)] + 1
        return self.chain[i] if i < len(self.chain) else None

    def take(self, owner: object, w_gate_up: Int4Weight, w_down: Int4Weight,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`owner`'s experts dequantised, for the current stream: started ahead by `start`, or dequantised now."""
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)   # also before overwriting another owner's experts
            self.ready = None
        if self.holds is not owner:
            self._dequantize(owner, w_gate_up, w_down, dtype)
        return self.scratch

    def start(self, owner: object, w_gate_up: Int4Weight, w_down: Int4Weight, dtype: torch.dtype) -> None:
        """Queue `owner`'s dequantisation on the side stream, behind everything queued so far on the current one."""
        if not w_gate_up.qweight.is_cuda or self.holds is owner:
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=w_gate_up.qweight.device)
        self._ensure_scratch(w_gate_up, w_down, dtype)   # allocated on the current stream, which ends its last use
        self.stream.wait_stream(torch.cuda.current_stream())   # the MoE before it is done with the scratch
        with torch.cuda.stream(self.stream):
            self._dequantize(owner, w_gate_up, w_down, dtype)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def _ensure_scratch(self, w_gate_up: Int4Weight, w_down: Int4Weight, dtype: torch.dtype) -> None:
        shapes = [(*w.qweight.shape[:-2], w.in_features, w.out_features) for w in (w_gate_up, w_down)]
        if self.scratch is None or self.scratch[0].dtype != dtype or [s.shape for s in self.scratch] != shapes:
            self.scratch = tuple(torch.empty(shape, dtype=dtype, device=w_gate_up.qweight.device) for shape in shapes)

    def _dequantize(self, owner, w_gate_up, w_down, dtype) -> None:
        self._ensure_scratch(w_gate_up, w_down, dtype)
        for w, out in zip((w_gate_up, w_down), self.scratch):
            dequantize_triton(w, dtype, out=out)
        self.holds = owner
