"""A table read a few rows at a time (the PLE n-gram table): on the compute device, or in pinned host memory.

Flash-Next's n-gram table is 320,001,536 × 160 (102 GB in bf16, 51 GB as the FP8 release ships it: float8_e4m3fn
with one fp32 scale) and a token reads 16 rows of it. Placement "device" is a plain embedding gather; placement
"host" keeps the table in page-locked host memory, where a GPU kernel reads the rows through unified virtual
addressing (flashnext/ops/host_gather.py). A host table stays where it is under `model.to(...)`: `_apply` skips it.
The parameter is called `weight`, so the state_dict key stays `...ple_embedding.ngram_embedding.weight`.
"""
from __future__ import annotations

import torch
from torch import nn

from flashnext.weights.pinned import host_empty, pin_in_place

PLACEMENTS = ("auto", "device", "host")
HOST_TABLE_BYTES = 4 << 30  # "auto" puts larger tables in host memory


def choose_placement(placement: str, nbytes: int) -> str:
    """"auto" → "host" for a table larger than HOST_TABLE_BYTES, else "device"."""
    if placement not in PLACEMENTS:
        raise ValueError(f"PLE placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    if placement == "auto":
        return "host" if nbytes > HOST_TABLE_BYTES else "device"
    return placement


class RowTable(nn.Module):
    def __init__(self, num_rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, dim))
        nn.init.normal_(self.weight)  # as nn.Embedding, which this replaces
        # fp8 storage: rows are weight · scale (one fp32 scale for the table, as the FP8 release ships it)
        self.register_buffer("scale", None, persistent=False)
        self.placement = "device"
        self.compute_dtype: torch.dtype | None = None  # output dtype when forward is not told; None: see forward

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def set_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None, placement: str = "device") -> None:
        """Take `weight` (and, for fp8, its `scale`) as the table, where it already lives."""
        if weight.shape != self.weight.shape:
            raise ValueError(f"table of shape {tuple(weight.shape)} where {tuple(self.weight.shape)} is expected")
        if (weight.element_size() == 1) != (scale is not None):
            raise ValueError("an fp8 table needs its scale, and only an fp8 table has one")
        assert placement in ("device", "host"), placement
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = None if scale is None else scale.to(torch.float32).reshape(())
        self.placement = placement

    def to_host(self, pin: bool | None = None) -> None:
        """Move the table to host memory (pinned when CUDA is available, or `pin`); the device copy is freed."""
        pin = torch.cuda.is_available() if pin is None else pin
        src = self.weight.detach()
        if src.device.type == "cpu" and (not pin or src.is_pinned()):
            host = src
        elif src.device.type == "cpu" and src.is_contiguous():
            host = pin_in_place(src, "the PLE table")   # read into host memory already: lock it where it is
        else:
            host = host_empty(tuple(src.shape), src.dtype, pin, "the PLE table")
            host.copy_(src)
        self.set_weight(host, None if self.scale is None else self.scale.cpu(), "host")

    def _apply(self, fn, recurse=True):
        if self.placement == "host":
            return self  # pinned host memory in its storage dtype: neither .to(device) nor .to(dtype) moves it
        if self.weight.element_size() > 1:
            return super()._apply(fn, recurse)
        # fp8 keeps its dtype (and the scale its fp32) under model.to(dtype): follow only the device fn picks
        device = fn(torch.empty(0, device=self.weight.device)).device
        self.weight = nn.Parameter(self.weight.detach().to(device), requires_grad=False)
        self.scale = self.scale.to(device)
        return self

    def forward(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """rows [...] int64 on the compute device → [..., dim] in `dtype` (default: compute_dtype, else the
        table's dtype, fp32 for fp8). No host sync and no data-dependent allocation: CUDA-graph safe."""
        from flashnext.ops import host_gather  # imports Triton: only when a model first runs

        if dtype is None:
            dtype = self.compute_dtype or (torch.float32 if self.weight.element_size() == 1 else self.weight.dtype)
        if self.placement == "host" and rows.device.type == "cuda":
            return host_gather.gather_rows_triton(self.weight, rows, dtype, self.scale)
        return host_gather.gather_rows(self.weight, rows, dtype, self.scale)

    def extra_repr(self) -> str:
        scaled = ", scaled" if self.scale is not None else ""
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, {self.weight.dtype}{scaled}, {self.placement}"
