"""What the launch heuristics ask of a device, looked up once per device."""
from __future__ import annotations

import functools

import torch

CPU_SMS = 8   # off a GPU (the Triton interpreter in the tests) the heuristics plan for this many


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (CPU_SMS elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


@functools.cache
def compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; (0, 0) elsewhere."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
