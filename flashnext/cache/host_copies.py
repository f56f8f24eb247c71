"""The host tier's copies down from the device, on a CUDA stream of their own and not waited for by the host: the
engine thread goes on launching steps while a piece of a conversation crosses PCIe (the write-behind between decode
steps, PrefixCache.copy_down_one, relies on it — a synchronous copy would wait for the step queued ahead first).

Each owner's copies (a stored batch of blocks, a snapshot) end with an event; whoever reads the host buffers (a
restore, a move to disk) waits for it first — by then, mostly long passed —, and a buffer given back to the arena is
handed out again only once it has passed (PinnedArena.give_back), without a host wait. The device
tensors a copy reads stay allocated until it has read them (record_stream), and the bytes in flight are bounded:
the gathered blocks are device memory beside a step's activations (the memory plan's slack is 1 GiB). The bound is
checked before a copy, after its piece was gathered (the peak is the bound plus a piece); snapshots count toward it
though their tensors are the device snapshot's own.
"""
from __future__ import annotations

from collections import deque

import torch

from flashnext.cache.cache_entry import copy_tensors, tensor_bytes

IN_FLIGHT_BYTES = 512 << 20   # ~4 write pieces of Flash-Next blocks (~100 MB each) and a snapshot (~115 MB)


class HostCopies:
    def __init__(self, limit_bytes: int = IN_FLIGHT_BYTES):
        self.stream: torch.cuda.Stream | None = None    # made at the first copy, on the device of its tensors
        self.limit = limit_bytes
        self.in_flight: deque[tuple[torch.cuda.Event, int, object]] = deque()   # (event, bytes, owner), oldest first
        self.in_flight_bytes = 0

    def copy(self, owner, tensors: dict[str, torch.Tensor], into: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Page-locked host copies of device `tensors` (in `into` when given, as copy_tensors), queued behind the
        work the current stream has queued so far."""
        nbytes = tensor_bytes(tensors)
        self._retire(self.limit - nbytes)
        device = next(iter(tensors.values())).device
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))   # the device's, whichever is current
        with torch.cuda.stream(self.stream):
            out = copy_tensors(tensors, "cpu", True, into=into, wait=False)
        for t in tensors.values():
            t.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.in_flight.append((event, nbytes, owner))
        self.in_flight_bytes += nbytes
        return out

    def busy(self) -> bool:
        """Whether copies are still in flight (none is waited for)."""
        self._retire(None)
        return bool(self.in_flight)

    def pending(self, owner) -> torch.cuda.Event | None:
        """The event behind the last copy of `owner` still in flight, or None (a few entries: the bytes are bounded)."""
        self._retire(None)
        return next((event for event, _, o in reversed(self.in_flight) if o == owner), None)

    def wait(self, owner) -> None:
        """Until the copies of `owner` are done (at once when they are, or it made none)."""
        event = self.pending(owner)
        if event is not None:
            event.synchronize()

    def wait_all(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._retire(None)

    def _retire(self, fit_bytes: int | None) -> None:
        """Forget the copies that have passed; with `fit_bytes`, also wait for the oldest until at most that many
        bytes are in flight."""
        while self.in_flight:
            event, nbytes, _ = self.in_flight[0]
            if not event.query():
                if fit_bytes is None or self.in_flight_bytes <= fit_bytes:
                    return
                event.synchronize()
            self.in_flight.popleft()
            self.in_flight_bytes -= nbytes
