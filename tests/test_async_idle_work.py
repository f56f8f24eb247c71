"""The engine thread's background work (AsyncLLM._loop): after IDLE_WORK_AFTER_S without a request it asks the engine
for one piece of idle work (the host tier's idle copy: PrefixCache.copy_down_one), then the next, checking its inbox
in between — not waiting IDLE_WORK_AFTER_S again before each piece (a 58K-token Flash-Next conversation is ~15
pieces: the waits had spread its copy over ~0.85 s of idleness on the H200, session 15); the process's own idle work
(`on_idle`: the server's full garbage collections) comes after the engine's, only while the engine has none."""
import threading
from types import SimpleNamespace

from flashnext.engine import async_llm


def fake_engine(has_work, idle_work):
    return SimpleNamespace(tokenizer=None, config=None, max_model_len=1, model_name="m",
                           loaded=SimpleNamespace(path="p"), memory_plan=None, prefix_cache=None,
                           has_work=has_work, idle_work=idle_work, step=lambda launched=None: [],
                           shutdown=lambda: None)


def test_idle_work_goes_piece_after_piece(monkeypatch):
    waits = []

    class RecordingEvent(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(async_llm, "threading",
                        SimpleNamespace(Event=RecordingEvent, Lock=threading.Lock, Thread=threading.Thread))
    pieces, done, work = [], threading.Event(), [False]

    def idle_work() -> bool:
        pieces.append(len(waits))     # the waits before this piece
        if len(pieces) == 3:          # a request comes: a step, and the wait before idle work again
            work[0] = True
        if len(pieces) == 6:
            done.set()
            return False
        return True

    def has_work() -> bool:
        busy, work[0] = work[0], False
        return busy

    llm = async_llm.AsyncLLM(fake_engine(has_work, idle_work))
    assert done.wait(10)
    llm.shutdown()
    assert pieces == [1, 1, 1, 2, 2, 2] and waits[:2] == [async_llm.IDLE_WORK_AFTER_S] * 2


def test_the_process_idle_work_comes_after_the_engine_pieces():
    engine_pieces, order, done = [2], [], threading.Event()

    def idle_work() -> bool:
        order.append("engine")
        engine_pieces[0] -= 1
        return engine_pieces[0] >= 0

    def on_idle() -> bool:
        order.append("process")
        if order.count("process") == 2:
            done.set()
        return False

    llm = async_llm.AsyncLLM(fake_engine(lambda: False, idle_work), on_idle=on_idle)
    assert done.wait(10)
    llm.shutdown()
    assert order[:5] == ["engine", "engine", "engine", "process", "engine"]
