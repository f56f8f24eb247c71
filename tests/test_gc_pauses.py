"""server/gc_pauses.py: a collection at least as long as the threshold is logged (and a shorter one is not), and
the startup heap's freeze puts the surviving objects out of the collector's reach (undone after the test); the idle
full collections run once the collector's schedule has one due, not before, with the collector's own made rarer
meanwhile (its threshold put back after each test)."""
import gc
import logging
import weakref

from flashnext.server.gc_pauses import IdleFullCollections, PauseLog, freeze_startup_heap


def test_a_long_collection_is_logged_and_a_short_one_is_not(caplog):
    quiet, loud = PauseLog(threshold_s=3600.0).install(), PauseLog(threshold_s=0.0).install()
    try:
        with caplog.at_level(logging.WARNING, logger="flashnext.server"):
            gc.collect()
    finally:
        quiet.remove()
        loud.remove()
    assert loud.long_pauses == 1 and quiet.long_pauses == 0
    assert [r.getMessage() for r in caplog.records if "generation-2 collection took" in r.getMessage()]
    assert quiet not in gc.callbacks and loud not in gc.callbacks


def test_freezing_the_startup_heap_moves_its_objects_out_of_reach():
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > before
        # a cycle made after the freeze is still the collector's
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()


class Node:
    pass


def test_full_collections_wait_for_the_engine_to_be_idle():
    saved = gc.get_threshold()
    gc.set_threshold(saved[0], saved[1], 3)
    pause_log = PauseLog(threshold_s=0.0).install()
    idle = IdleFullCollections(pause_log, busy_factor=10)
    try:
        assert gc.get_threshold()[2] == 30
        gc.collect()                      # a full collection: nothing due after it
        assert not idle()
        for _ in range(3):                # three collections of the middle generation: a full one is due
            gc.collect(1)
        cycle = Node()
        cycle.self = cycle
        freed = weakref.ref(cycle)
        del cycle
        counted = pause_log.long_pauses
        assert idle() and gc.get_count()[2] == 0 and freed() is None
        assert pause_log.long_pauses == counted   # the idle collection is no one's pause
        assert not idle()
    finally:
        idle.restore()
        pause_log.remove()
        gc.set_threshold(*saved)
    assert gc.get_threshold() == saved
