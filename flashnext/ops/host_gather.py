"""Gather a few rows of a big table: `out = table[rows] · scale`, the PLE n-gram lookup.

    table [R, D]  any float dtype (bf16, fp32, or float8_e4m3fn with one fp32 `scale`)
    rows  [...]   int64 row ids, all < R
    out   [..., D] in `out_dtype`, on the rows' device

`gather_rows` is the reference (torch indexing; it reads the table where it lives, so a host table with CUDA
rows costs a round trip through the host and a sync). `gather_rows_triton` is the fast path for a table in
*pinned* host memory and rows on the GPU: a kernel reads the rows straight over PCIe through unified virtual
addressing (zero-copy, no host sync, CUDA-graph safe). Flash-Next reads 16 rows × 160 per token from a 51–102 GB
table; PERF.md measured such a gather at 5.7 µs, against 33 µs for gathering on the host and copying.

How a host tensor reaches the kernel: Triton's launcher turns each tensor argument into a device address with
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER) (triton/backends/nvidia/driver.c, extractPointer).
For page-locked, mapped host memory that returns the address the GPU uses for it; for ordinary pageable memory
it fails ("Pointer argument cannot be accessed from Triton (cpu tensor?)"). So the table must be pinned
(flashnext.weights.pinned.host_empty) and is passed as is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def gather_rows(table: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: rows [...] → [..., D] in out_dtype on rows' device (any placement; see module doc)."""
    index = rows.to(table.device)
    if table.element_size() == 1:  # fp8: index its bytes (indexing kernels do not cover every float8 type)
        picked = table.view(torch.uint8)[index].view(table.dtype)
    else:
        picked = table[index]
    if scale is not None:
        picked = picked.float() * scale.to(picked.device, torch.float32)
    return picked.to(device=rows.device, dtype=out_dtype)


@triton.jit(do_not_specialize=["num_rows"])
def _gather_rows_kernel(table_ptr, rows_ptr, out_ptr, scale, num_rows, dim, row_stride,
                        HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < num_rows
    # int64 row ids: the Flash-Next table has 5.1e10 elements, past int32 offsets
    row = tl.load(rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    mask = mask_r[:, None] & (offs_d[None, :] < dim)
    # no `other`: integer 0 does not cast to fp8, and masked lanes are never stored
    values = tl.load(table_ptr + row[:, None] * row_stride + offs_d[None, :], mask=mask).to(tl.float32)
    if HAS_SCALE:
        values = values * scale
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * dim + offs_d[None, :], values.to(out_ptr.dtype.element_ty),
             mask=mask)


def gather_rows_triton(table: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as gather_rows. `table` pinned on the host (or on the rows' device), `scale` a one-element
    tensor on the host (read once here, with no device sync: it is baked into the launch, so a captured CUDA
    graph keeps it). Row ids are not bounds-checked: an id ≥ R reads outside the table."""
    assert table.dim() == 2 and table.stride(1) == 1, "the table must be [R, D] with contiguous rows"
    assert scale is None or scale.device.type == "cpu", "the scale of a host table lives on the host"
    dim = table.shape[1]
    flat = rows.reshape(-1)
    out = torch.empty(*rows.shape, dim, dtype=out_dtype, device=rows.device)
    if flat.numel() == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(16, 4096 // block_d))
    grid = (triton.cdiv(flat.numel(), block_r),)
    _gather_rows_kernel[grid](table, flat, out, 1.0 if scale is None else float(scale), flat.numel(), dim,
                              table.stride(0), HAS_SCALE=scale is not None, BLOCK_R=block_r, BLOCK_D=block_d)
    return out
