"""Python's cyclic garbage collector in the serving process: its long pauses logged, and the heap built at startup
kept out of its full collections.

A full (generation 2) collection walks every tracked container object of the process and stops the event loop and
the engine meanwhile. On the H200, two idle benches (sessions 21 and 22) each had one resume of eight whose host-tier
restore took 0.36–0.39 s against ~0.03 s for the others (session 22: 0.389 s of it the install), with nothing else
to tell it apart — the pattern of a full collection landing there (a prefix-cache install allocates thousands of trie
nodes at once). Freezing the startup heap after the warm-up (the model's modules, the imports: what lives as long as
the server) leaves the collector to walk only what serving has created since (`gc.freeze`: frozen objects are still
freed when their references go; only reference cycles among them would never be collected, and the startup heap is
collected first). The log line names each collection over LONG_PAUSE_S, so that a slow first token can be matched to
one.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("flashnext.server")

LONG_PAUSE_S = 0.02


def freeze_startup_heap() -> int:
    """Collect, then move every object that survives into the collector's permanent generation → how many."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("python gc: %d objects of the startup heap frozen (out of the collector's full collections)", frozen)
    return frozen


class PauseLog:
    """A gc.callbacks hook that logs every collection of `threshold_s` or longer; `install`/`remove` it."""

    def __init__(self, threshold_s: float = LONG_PAUSE_S):
        self.threshold_s = threshold_s
        self.started: float | None = None
        self.long_pauses = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        if self.started is None:
            return
        seconds, self.started = time.perf_counter() - self.started, None
        if seconds >= self.threshold_s:
            self.long_pauses += 1
            log.warning("python gc: a generation-%d collection took %.3f s (%d objects collected)",
                        info["generation"], seconds, info["collected"])

    def install(self) -> PauseLog:
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        gc.callbacks.remove(self)
