"""Page-locked host memory of exactly the size asked for; small uploads that do not make the host wait (`upload`);
the address a kernel reads page-locked memory at (`device_address`).

Not torch.empty(pin_memory=True) / .pin_memory(): torch's caching host allocator rounds every block up to a
power of two, so a 51 GB PLE table would lock 64 GiB (a 102 GB one 128 GiB) and 63 GB of INT4 experts 64 GiB.
Instead the tensor's own range is registered with cudaHostRegister (what torch itself does for shared-memory
tensors, torch/cuda/_pin_memory_utils.py), mapped so that GPU kernels can read it through unified virtual
addressing, and unregistered when the storage dies. Registering faults every page in: they are touched first.
"""
from __future__ import annotations

import ctypes
import functools
import weakref

import torch

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


def pin_in_place(tensor: torch.Tensor, what: str = "host memory") -> torch.Tensor:
    """Page-lock a contiguous CPU tensor's memory where it is (no copy); returns the tensor."""
    if tensor.is_pinned() or not tensor.numel():
        return tensor
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
    if err != 0:
        raise RuntimeError(f"could not pin {nbytes / 1e9:.1f} GB of {what} (cudaHostRegister error {err}); "
                           "is the host short of RAM?")
    finalizer = weakref.finalize(tensor.untyped_storage(), cudart.cudaHostUnregister, tensor.data_ptr())
    finalizer.atexit = False  # the process's exit frees it anyway, maybe after the CUDA context
    return tensor


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, what: str = "host memory") -> torch.Tensor:
    """An uninitialised CPU tensor, page-locked and mapped for the GPU when `pin`."""
    tensor = torch.empty(shape, dtype=dtype)
    if pin and tensor.numel():
        tensor.view(-1).view(torch.uint8)[::4096].zero_()  # fault the pages in (one byte per page, in parallel)
        pin_in_place(tensor, what)
    return tensor


def meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int | None:
    """Bytes of a /proc meminfo-style field (kB: MemAvailable, or VmRSS of /proc/self/status), or None where there
    is none (not Linux): what a page-lock budget is checked against (cache/host_tier.py)."""
    try:
        with open(path) as meminfo:
            for line in meminfo:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def upload(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst ← the host tensor src, in stream order and without a host wait when dst is on a GPU: through a page-locked
    copy (torch's caching host allocator reuses it only once the upload has run), where from pageable memory the
    driver may synchronise the stream first and the host waits behind the steps queued. → dst."""
    return dst.copy_(src.pin_memory() if dst.is_cuda and not src.is_pinned() else src, non_blocking=True)


def staged(values: list, device) -> torch.Tensor:
    """Integers as an int64 host tensor to copy to `device` without a host wait: made page-locked at once when the
    device is a GPU (see upload) — one host copy, not a pageable tensor then a pinned one."""
    return torch.tensor(values, dtype=torch.long, pin_memory=torch.device(device).type == "cuda")


def to_device(values: list, device) -> torch.Tensor:
    """Integers as an int64 tensor on `device`, copied without a host wait (staged): a torch.tensor(..., device=) from
    a list waits for every step queued on the stream first."""
    return staged(values, device).to(device, non_blocking=True)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def device_address(tensor: torch.Tensor, device: torch.device) -> int:
    """Where a kernel on `device` finds `tensor`: its own address for memory of that device (or off a GPU, where
    the interpreter reads host memory); for page-locked, mapped host memory the device pointer the driver gives
    (what Triton's launcher asks for a tensor argument: cuPointerGetAttribute)."""
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor.data_ptr()
    if not tensor.is_pinned():
        raise ValueError("a kernel can read host memory only when it is page-locked and mapped")
    out = ctypes.c_uint64()
    err = _libcuda().cuPointerGetAttribute(ctypes.byref(out), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                           ctypes.c_uint64(tensor.data_ptr()))
    if err:
        raise RuntimeError(f"cuPointerGetAttribute failed ({err}) for a host tensor")
    return out.value
