"""Hyper-connection mix and inject (models/layers/hyper_connection.py) as ops, for the decode step.

Shapes (N rows, hc streams of H = hidden, R = lowrank):
    h [N, hc·H]; norm_weight [hc·H] (zero-centred: the norm scales by 1 + w); w_down [R, hc·H];
    w_up [hc·H, R]; w_inject [hc, hc·H] or None (the final mixer has none)
    mix    → block_input [N, H], inject_weights [N, hc] or None   (h's dtype)
    inject → h + weights ⊗ block_output  [N, hc·H]

`hc_mix_reference` / `hc_inject_reference` are the specification and round where the module rounds: the
normed streams to h's dtype (ZeroCenteredRMSNorm's .type_as), every F.linear output, each elementwise op
of a 16-bit tensor, and the mean over streams once (fp32 sum). `hc_mix` dispatches CUDA tensors of
- 1–4 rows (below rows_kernel_min(), 5; FLASHNEXT_HC_ROWS_MIN) to the one-row Triton kernels
  (ops/hyper_connection_triton.py: weights in registers, a loop over rows that costs ~4.5–6 µs a row);
- 5 to decode_max_rows() rows (16; FLASHNEXT_HC_DECODE_MAX_ROWS; both read when a step is traced or captured) to
  the tensor-core kernels (ops/hyper_connection_rows_triton.py: each weight read once for all rows, rows as tl.dot's
  M side, split-K summed in the launch). H200, session 13: one mix alone in a graph, the one-row kernels take 6.6 /
  15.7 / 26.7 / 49.6 µs at 1 / 2 / 4 / 8 rows, the tensor-core ones 22.9 / 23.5 / 23.7 at 2 / 4 / 8, the cuBLAS path
  (below) ~27 at any 2–16; in the captured Flash-Next step at 64K (`gpu_decode.py --batch`) the tensor-core mix
  gave 8.283 / 10.249 / 14.085 ms a step at 2 / 4 / 8 rows against 7.431 / 10.333 / 14.531 with the one-row kernels
  up to 4 rows and cuBLAS above — so from 5 rows (the batch buckets of 8 and 16);
- more rows (prefill; FLASHNEXT_HC_DECODE_MAX_ROWS above 16 sends short chunks to the tensor-core kernels too, 16
  rows a program: fewer launches a mix than here — the eager step's host time, which dominates a short chunk's:
  182 against 197 ms for an eager 75-token step at 58K in session 14, one turn each) to the reference's math with cuBLAS for the GEMMs (each weight read once for all rows), the
  RMSNorm kernel for the streams' norm (one pass over [T, hc·H] instead of ~8 fp32 passes; on the H200 the pow and
  mean kernels of these norms and GatedDeltaNet's alone were ~3% of a 10K Flash-Next prefill) and one kernel for
  the final sigmoid·mean over streams (`hc_combine`).
An earlier tensor-core mix (session 12: a K loop over each stream in 84 programs, the weights loaded after the
wait) took 24.8–28.3 µs at 1–16 rows and was removed.
`hc_inject` is elementwise: the Triton kernel for any CUDA batch.
FLASHNEXT_HC=reference forces the reference (to bisect a wrong answer on the GPU).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashnext.ops.rms_norm import rms_norm, rms_norm_reference

DECODE_MAX_ROWS = 16  # decode_max_rows()'s default (see the module's docstring)
ROWS_KERNEL_MIN = 5   # rows_kernel_min()'s default: decode batches of 8 and 16 rows (see the module's docstring)


def decode_max_rows() -> int:
    """The most rows hc_mix sends to the Triton kernels (see the module's docstring)."""
    return int(os.environ.get("FLASHNEXT_HC_DECODE_MAX_ROWS", DECODE_MAX_ROWS))


def rows_kernel_min() -> int:
    """From this many rows the Triton mix is the tensor-core one (ops/hyper_connection_rows_triton.py), below it the
    one-row kernels (FLASHNEXT_HC_ROWS_MIN, read when a step is traced or captured)."""
    return int(os.environ.get("FLASHNEXT_HC_ROWS_MIN", ROWS_KERNEL_MIN))


def hc_combine_reference(up: torch.Tensor, normed: torch.Tensor, hc: int, hidden: int) -> torch.Tensor:
    """The mix's last step: up-projection logits [N, hc·H] and normed streams [N, hc·H] → the mean over streams of
    sigmoid(up) × normed, [N, H] (each elementwise op rounds to the dtype, the mean sums in fp32)."""
    return (torch.sigmoid(up).unflatten(-1, (hc, hidden)) * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)


def hc_mix_reference(h: torch.Tensor, norm_weight: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
                     w_inject: torch.Tensor | None, hc: int, hidden: int, eps: float,
                     norm=rms_norm_reference, combine=hc_combine_reference) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [N, hc·H] → (block input [N, H], injection weights [N, hc] or None), as HyperConnection.mix.
    `norm` / `combine`: the streams' RMSNorm and the final sigmoid·mean — the references, or their kernels'
    dispatchers for prefill."""
    normed = norm(h, norm_weight, eps, group_size=hidden)
    mix = F.silu(F.linear(normed, w_down) / hc)
    block_input = combine(F.linear(mix, w_up), normed, hc, hidden)
    if w_inject is None:
        return block_input, None
    return block_input, 2 * torch.sigmoid(F.linear(normed, w_inject) / hc)


def hc_inject_reference(h: torch.Tensor, block_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """h [N, hc·H], block_output [N, H], weights [N, hc] → new h [N, hc·H], as HyperConnection.inject."""
    return h + (block_output.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


def _use_triton(*tensors: torch.Tensor, max_rows: int | None = None) -> bool:
    h = tensors[0]
    max_rows = decode_max_rows() if max_rows is None else max_rows
    if h.device.type != "cuda" or os.environ.get("FLASHNEXT_HC", "triton") == "reference":
        return False
    # The kernels round to one activation dtype; mixed dtypes (torch would promote) take the reference.
    return h.dim() == 2 and h.shape[0] <= max_rows and all(t.dtype == h.dtype for t in tensors)


ELEMENTWISE_MAX_ROWS = 65535   # the inject and combine kernels' rows are their grid's second dimension


def hc_mix(h: torch.Tensor, norm_weight: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
           w_inject: torch.Tensor | None, hc: int, hidden: int,
           eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See hc_mix_reference. On the Triton path: two launches, no host sync, CUDA-graph capturable."""
    weights = [w for w in (w_down, w_up, w_inject) if w is not None]
    if _use_triton(h, *weights):
        return _triton_mix(h, None, norm_weight, w_down, w_up, w_inject, hc, hidden, eps)[:2]
    return hc_mix_reference(h, norm_weight, w_down, w_up, w_inject, hc, hidden, eps, norm=rms_norm,
                            combine=hc_combine)


def _triton_mix(h, pending, norm_weight, w_down, w_up, w_inject, hc, hidden, eps):
    """The Triton mix for h's rows: the tensor-core kernels from rows_kernel_min() rows, else the one-row kernels
    → (block input, injection weights or None, the streams mixed: h, injected when an injection was pending)."""
    if h.shape[0] >= rows_kernel_min():
        from flashnext.ops.hyper_connection_rows_triton import hc_mix_rows_triton

        return hc_mix_rows_triton(h, pending, norm_weight, w_down, w_up, w_inject, hc, hidden, eps)
    from flashnext.ops.hyper_connection_triton import hc_mix_injected_triton, hc_mix_triton

    if pending is None:
        return (*hc_mix_triton(h, norm_weight, w_down, w_up, w_inject, hc, hidden, eps), h)
    return hc_mix_injected_triton(h, *pending, norm_weight, w_down, w_up, w_inject, hc, hidden, eps)


def hc_combine(up: torch.Tensor, normed: torch.Tensor, hc: int, hidden: int) -> torch.Tensor:
    """See hc_combine_reference; CUDA: one kernel instead of sigmoid, multiply and mean over [N, hc·H]."""
    if not _use_triton(up, normed, max_rows=ELEMENTWISE_MAX_ROWS):
        return hc_combine_reference(up, normed, hc, hidden)
    from flashnext.ops.hyper_connection_triton import hc_combine_triton

    return hc_combine_triton(up, normed, hc, hidden)


def hc_inject(h: torch.Tensor, block_output: torch.Tensor, weights: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """See hc_inject_reference. Out of place by default; out=h updates h in place (each element is read
    and written by the same thread) and saves the decode step an allocation."""
    if not _use_triton(h, block_output, weights, max_rows=ELEMENTWISE_MAX_ROWS):
        result = hc_inject_reference(h, block_output, weights)
        return result if out is None else out.copy_(result)
    from flashnext.ops.hyper_connection_triton import hc_inject_triton

    return hc_inject_triton(h, block_output, weights, out)


@dataclass(frozen=True)
class PendingInjection:
    """The streams h + weights ⊗ block_output, not computed yet: in a decode step the next mix computes them on its
    way in (`hc_mix_injected`), which saves the inject launch."""
    h: torch.Tensor
    block_output: torch.Tensor
    weights: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return hc_inject(self.h, self.block_output, self.weights)


def hc_mix_injected(pending: PendingInjection, norm_weight: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor,
                    w_inject: torch.Tensor | None, hc: int, hidden: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """hc_mix of the injected streams → (block input, injection weights or None, the injected streams): on the
    Triton path in the mix's two launches (the down kernel injects; one launch fewer a block, 96 a Flash-Next step:
    4.615 → 4.557 ms a step on the H200, session 9), elsewhere — or with FLASHNEXT_HC_FUSED_INJECT=0, to A/B it —
    hc_inject then hc_mix."""
    weights = [w for w in (w_down, w_up, w_inject) if w is not None]
    if (os.environ.get("FLASHNEXT_HC_FUSED_INJECT", "1") == "1"
            and _use_triton(pending.h, pending.block_output, pending.weights, *weights)):
        return _triton_mix(pending.h, (pending.block_output, pending.weights), norm_weight, w_down, w_up, w_inject,
                           hc, hidden, eps)
    h = pending.materialize()
    return (*hc_mix(h, norm_weight, w_down, w_up, w_inject, hc, hidden, eps), h)
