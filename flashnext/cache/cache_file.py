"""Read a prefix-cache file (safetensors) in one read, verifying its checksum from the raw bytes.

safetensors' `safe_open(...).get_tensor` costs ~60 µs a tensor on the 2-core dev machine, which added up when
the disk tier kept a file per KV block (1.9–2.6 s per 1,000 blocks of 24 tensors); it now keeps batches of blocks
(cache/disk_tier.py), still read this way. This reads the file with one `readinto`, parses the documented header (8-byte
little-endian length, JSON {name: {dtype, shape, data_offsets}, "__metadata__": {...}}), hashes the tensors'
bytes straight from the buffer (`tensors_digest`, which the writer uses too), and returns tensors
that are views of that buffer (`torch.frombuffer`: no copy). Writing stays with safetensors' `save_file`.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from flashnext.weights.safetensors_dtypes import SAFETENSORS_DTYPES


class UnreadableFile(ValueError):
    pass


def tensors_digest(named_buffers) -> str:
    """sha256 of (name, bytes) pairs in name order: what a cache file's header records as its checksum."""
    digest = hashlib.sha256()
    for name, buffer in sorted(named_buffers, key=lambda pair: pair[0]):
        digest.update(name.encode())
        digest.update(buffer)
    return digest.hexdigest()


def _header(path: Path, raw: bytes) -> dict:
    """A safetensors header's JSON (the bytes after its 8-byte length), or UnreadableFile."""
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise UnreadableFile(f"{path} has a damaged header: {e}") from None
    if not isinstance(header, dict):
        raise UnreadableFile(f"{path} has a damaged header: not an object")
    return header


def read_header(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return _header(path, f.read(length)).get("__metadata__") or {}


def read_cache_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor], str]:
    """→ (metadata, tensors, sha256 hex of the tensors as disk_tier.checksum computes it). Raises OSError when the
    file cannot be read, UnreadableFile when it is not a well-formed safetensors file."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        buf = bytearray(size)
        if f.readinto(buf) != size:
            raise UnreadableFile(f"{path} changed while it was read")
    view = memoryview(buf)
    length = int.from_bytes(view[:8], "little")
    header = _header(path, bytes(view[8: 8 + length]))
    try:
        meta = header.pop("__metadata__", None) or {}
        base = 8 + length
        spans = {name: (SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), *info["data_offsets"])
                 for name, info in header.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise UnreadableFile(f"{path} has a damaged header: {e}") from None
    tensors = {}
    for name, (dtype, shape, start, end) in spans.items():
        if not 0 <= start <= end <= size - base or end - start != math.prod(shape) * dtype.itemsize:
            raise UnreadableFile(f"{path}: tensor {name} lies outside the file or has the wrong size")
        if end > start:
            tensors[name] = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=base + start).view(shape)
        else:
            tensors[name] = torch.empty(shape, dtype=dtype)
    digest = tensors_digest((name, view[base + start: base + end]) for name, (_, _, start, end) in spans.items())
    return meta, tensors, digest
