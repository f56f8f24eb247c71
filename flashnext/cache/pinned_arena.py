"""Pinned host memory for the host tier, allocated once and reused: buffers carved from slabs that are page-locked
in place (weights/pinned.host_empty) — all at once by `reserve`, else as the tier grows — and recycled, by size,
when the tier drops what they held.
The tier's entries come in few sizes (a model's snapshots are all alike; block pieces are powers of two of equal
blocks), so a buffer of the exact size (in whole pages) is kept for the next entry of that size: what is pinned
is what the tier counts, give or take a page per entry.

Why not torch.empty(pin_memory=True) per entry: each new allocation is a cudaHostAlloc, which page-locks on the
spot — on the H200's host ~58 ms for each of the three entry buffers of a 32K-token Flash-Next turn (a snapshot
is 116 MB), inside the engine step that moves the entry down: the turn waited ~180 ms for its first token. Registering a slab in place costs
~0.1 s per GiB once; a recycled buffer costs nothing. A buffer given back may still be the source of an
asynchronous host→device copy, or the target of a device→host one still crossing: it is handed out again only once
an event recorded at give-back (and the copy's own) has passed (one not yet passed is left for later, not waited
for).

`reserve` page-locks every slab the capacity allows at once (the host tier does at startup on a GPU; estimated ~4 s
for 40 GB from the ~0.1 s a GiB above, the startup log says): slabs registered as the tier grew cost an estimated
~0.14 s inside the write-down of each 58K-token conversation that needed new ones — on a request's path when the
write-down makes room for it (session 14's idle bench queued six of eight resumes 0.3–0.9 s; how much of that this
was is not measured).
"""
from __future__ import annotations

import torch

from flashnext.weights.pinned import host_empty

SLAB_BYTES = 1 << 30      # page-locked at a time (a smaller tier: its own size)
PAGE = 1 << 12            # buffers are whole pages


def size_class(nbytes: int) -> int:
    return -(-max(nbytes, 1) // PAGE) * PAGE


class PinnedArena:
    def __init__(self, capacity: int, pin: bool):
        self.capacity = capacity          # bytes of slabs at most (the tier's budget)
        # a tier smaller than SLAB_BYTES gets one slab of its size (in whole pages)
        self.slab_bytes = min(SLAB_BYTES, capacity // PAGE * PAGE)
        self.pin = pin
        self.slabs: list[torch.Tensor] = []
        self.current = -1                 # the slab buffers are carved from (-1: none yet)
        self.used = 0                     # bytes of it handed out
        self.free: dict[int, list[tuple[torch.Tensor, tuple[torch.cuda.Event, ...]]]] = {}
        self.misses = 0                   # requests it could not serve (the caller allocates on its own)

    @property
    def reserved(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def reserve(self) -> None:
        """Page-lock every slab the capacity allows now (take then never allocates)."""
        while self.slab_bytes and self.reserved + self.slab_bytes <= self.capacity:
            self.slabs.append(host_empty((self.slab_bytes,), torch.uint8, self.pin, "the host tier"))

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of nbytes, or None (larger than a slab, or the capacity is reached while no free buffer
        of this size is ready: buffers are never split or merged, and the caller then allocates on its own)."""
        size = size_class(nbytes)
        if size > self.slab_bytes:
            self.misses += 1
            return None
        free = self.free.get(size, [])
        for i, (buf, done) in enumerate(free):
            if all(event.query() for event in done):
                del free[i]
                return buf[:nbytes]
        if self.current < 0 or self.used + size > self.slab_bytes:   # the next slab (reserved, or new)
            if self.current + 1 == len(self.slabs):
                if self.reserved + self.slab_bytes > self.capacity:
                    self.misses += 1
                    return None
                self.slabs.append(host_empty((self.slab_bytes,), torch.uint8, self.pin, "the host tier"))
            self.current += 1
            self.used = 0
        buf = self.slabs[self.current][self.used: self.used + size]
        self.used += size
        return buf[:nbytes]

    def give_back(self, buf: torch.Tensor, written: torch.cuda.Event | None = None) -> None:
        """Return a buffer from `take` (any slice of it that starts where it starts) for reuse; `written`: the event
        behind a copy into it still in flight (host_copies.py), which must pass first too."""
        start = buf.data_ptr()
        for slab in self.slabs:
            offset = start - slab.data_ptr()
            if 0 <= offset < self.slab_bytes:
                break
        else:
            return   # not ours: an allocation of the caller's, freed with its tensors
        size = size_class(buf.numel())
        done = () if written is None else (written,)
        if self.pin and torch.cuda.is_available():
            read = torch.cuda.Event()
            read.record()
            done += (read,)
        self.free.setdefault(size, []).append((slab[offset: offset + size], done))
