"""Page-locked host memory of exactly the size asked for.

Not torch.empty(pin_memory=True) / .pin_memory(): torch's caching host allocator rounds every block up to a
power of two, so a 51 GB PLE table would lock 64 GiB (a 102 GB one 128 GiB) and 63 GB of INT4 experts 64 GiB.
Instead the tensor's own range is registered with cudaHostRegister (what torch itself does for shared-memory
tensors, torch/cuda/_pin_memory_utils.py), mapped so that GPU kernels can read it through unified virtual
addressing, and unregistered when the storage dies. Registering faults every page in: they are touched first.
"""
from __future__ import annotations

import weakref

import torch

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


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
