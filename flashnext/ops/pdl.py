"""Programmatic dependent launch (PDL, Hopper and later): a decode kernel starts while the one before it is still
running, loads what does not depend on it (its weights), and only then waits for it.

A batch-1 decode step is a chain of ~1,600 small kernels; each pays its launch, the ramp of its first DRAM loads
and its tail, during which the GPU's bandwidth sits idle (BENCHMARKS.md: the GEMVs and hyper-connection mixes
run at 15–25% of it). With PDL the next kernel's programs are already resident when this one ends and their
weight loads are in flight. The protocol every PDL kernel follows (Triton: `launch_pdl=True` at launch):
- before `wait_for_inputs`: loads of tensors no kernel of the step writes (weights, norm weights; not an
  expert cache's pool slots, which the MoE kernels write in captured decode steps) — nothing else: the previous kernel may still be writing activations, or reading memory the allocator has just handed
  to this kernel's outputs;
- `wait_for_inputs` in every program (it returns when the previous kernel has finished and its writes are
  visible, and so, transitively, everything before it), then `gdc_launch_dependents`, so that at most one
  kernel waits ahead of the running one.
Kernels launched without the flag (torch's, cuBLAS) start after their predecessor as usual; the wait is a no-op
in a kernel launched without it. CUDA graphs keep the dependency as a programmatic edge.

FLASHNEXT_PDL=0 turns it off (to bisect, or to measure what it buys: scripts/gpu_decode.py times both).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flashnext.ops.device import compute_capability


# Triton exposes the grid-dependency instructions (and the launch_pdl option) from 3.3 on.
_TRITON_HAS_PDL = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (CUDA, compute capability >= 9, a Triton that has it,
    FLASHNEXT_PDL not 0)."""
    return (device.type == "cuda" and _TRITON_HAS_PDL and os.environ.get("FLASHNEXT_PDL", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") != "1" and compute_capability(device)[0] >= 9)


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch: the PDL constexpr, and the launch flag when it is on."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait for the previous kernel (and all before it), then let the next one launch. Call in every program,
    after the loads of weights and before any load of an activation or any store."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
