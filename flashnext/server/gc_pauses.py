"""Python's cyclic garbage collector in the serving process: its long pauses logged, and the heap built at startup
kept out of its full collections.

A full (generation 2) collection walks every tracked container object of the process and stops the event loop and
the engine meanwhile. On the H200, two idle benches (sessions 21 and 22) each had one resume of eight whose host-tier
restore took 0.36–0.39 s against ~0.03 s for the others (session 22: 0.389 s of it the install), with nothing else
to tell it apart — what a full collection landing there would look like (a prefix-cache install allocates thousands
of trie nodes at once); not shown to be one, and not seen again in the three idle benches after the freeze. Freezing the startup heap after the warm-up (the model's modules, the imports: what lives as long as
the server) leaves the collector to walk only what serving has created since (`gc.freeze`: frozen objects are still
freed when their references go; only reference cycles among them would never be collected, and the startup heap is
collected first). The log line names each collection over LONG_PAUSE_S, so that a slow first token can be matched to
one.

The freeze did not end them: the next idle bench (session 23) still logged full collections of 29 and 38 ms that
collected nothing, one of them inside a resume whose first token came 35 ms after the others'. What serving builds is
large too (token lists of 58K ids that a collection walks item by item — on a workstation 30 of them add 13 ms to a
full collection, as arrays 0.7 —, the prefix trie's nodes, the tiers' lists of block hashes). So full collections move to
the engine's idle time (IdleFullCollections): the collector's own ones come 10× more rarely, and the engine thread runs
one whenever the collector would have, as a piece of its idle work — after AsyncLLM's IDLE_WORK_AFTER_S without a
request, where it costs no one a token; a server never idle still collects, on the collector's rarer schedule.
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
        self.engine_idle = False   # set by IdleFullCollections around its own collections: no one waits on those

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        if self.started is None:
            return
        seconds, self.started = time.perf_counter() - self.started, None
        if seconds >= self.threshold_s and not self.engine_idle:
            self.long_pauses += 1
            log.warning("python gc: a generation-%d collection took %.3f s (%d objects collected)",
                        info["generation"], seconds, info["collected"])

    def install(self) -> PauseLog:
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        gc.callbacks.remove(self)


BUSY_FACTOR = 10


class IdleFullCollections:
    """AsyncLLM's `on_idle`: the collector's automatic full collections made BUSY_FACTOR times rarer (its third
    threshold: full collections come after that many collections of the middle generation), and a full collection
    run here, when the engine is idle, wherever the collector's own schedule would have run one by now. → whether it
    collected (a piece of idle work was done). `restore` puts the collector's threshold back."""

    def __init__(self, pause_log: PauseLog | None = None, busy_factor: int = BUSY_FACTOR):
        self.pause_log = pause_log
        self.threshold = gc.get_threshold()
        self.due_after = self.threshold[2]
        gc.set_threshold(self.threshold[0], self.threshold[1], self.threshold[2] * busy_factor)

    def __call__(self) -> bool:
        if gc.get_count()[2] < self.due_after:
            return False
        if self.pause_log is not None:
            self.pause_log.engine_idle = True
        try:
            gc.collect()
        finally:
            if self.pause_log is not None:
                self.pause_log.engine_idle = False
        return True

    def restore(self) -> None:
        gc.set_threshold(*self.threshold)
