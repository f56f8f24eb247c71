"""Pinned host memory for the host tier, allocated once and reused: buffers of power-of-two size classes carved
from slabs that are page-locked in place as the tier grows (weights/pinned.host_empty), and recycled when the tier
drops what they held.

Why not torch.empty(pin_memory=True) per entry: each new allocation is a cudaHostAlloc, which page-locks on the
spot — on the H200's host ~58 ms for each of the three entry buffers of a 32K-token Flash-Next turn (a snapshot
is 116 MB), inside the engine step that moves the entry down: the turn waited ~180 ms for its first token. Registering a slab in place costs
~0.1 s per GiB once; a recycled buffer costs nothing. A buffer given back may still be the source of an
asynchronous host→device copy: it is handed out again only after an event recorded at give-back has passed.
"""
from __future__ import annotations

import torch

from flashnext.weights.pinned import host_empty

SLAB_BYTES = 1 << 30      # page-locked at a time as the tier grows (a smaller tier: its own size)
MIN_CLASS = 1 << 16       # the smallest buffer handed out (64 KiB)


def size_class(nbytes: int) -> int:
    return max(MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length())


class PinnedArena:
    def __init__(self, capacity: int, pin: bool):
        self.capacity = capacity          # bytes of slabs at most (the tier's budget)
        # a tier smaller than SLAB_BYTES gets one slab of its size (in whole MIN_CLASS units)
        self.slab_bytes = min(SLAB_BYTES, capacity // MIN_CLASS * MIN_CLASS)
        self.pin = pin
        self.slabs: list[torch.Tensor] = []
        self.used = 0                     # bytes of the last slab handed out
        self.free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self.misses = 0                   # requests it could not serve (the caller allocates on its own)

    @property
    def reserved(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least nbytes, or None (larger than a slab, or the capacity is reached: buffers
        never split or merge across classes, so a tier of mixed sizes can miss while slabs hold free buffers of
        other classes; the caller then allocates on its own)."""
        cls = size_class(nbytes)
        if cls > self.slab_bytes:
            self.misses += 1
            return None
        recycled = self.free.get(cls)
        if recycled:
            buf, done = recycled.pop()
            if done is not None:
                done.synchronize()
            return buf[:nbytes]
        if not self.slabs or self.used + cls > self.slab_bytes:
            if self.reserved + self.slab_bytes > self.capacity:
                self.misses += 1
                return None
            self.slabs.append(host_empty((self.slab_bytes,), torch.uint8, self.pin, "the host tier"))
            self.used = 0
        buf = self.slabs[-1][self.used: self.used + cls]
        self.used += cls
        return buf[:nbytes]

    def give_back(self, buf: torch.Tensor) -> None:
        """Return a buffer from `take` (any slice of it that starts where it starts) for reuse."""
        start = buf.data_ptr()
        for slab in self.slabs:
            offset = start - slab.data_ptr()
            if 0 <= offset < self.slab_bytes:
                break
        else:
            return   # not ours: an allocation of the caller's, freed with its tensors
        cls = size_class(buf.numel())
        done = None
        if self.pin and torch.cuda.is_available():
            done = torch.cuda.Event()
            done.record()
        self.free.setdefault(cls, []).append((slab[offset: offset + cls], done))
