"""Helpers the GPU check scripts share (they run from the repository root as `python3 scripts/NAME.py`, so this
imports as a plain module)."""
import contextlib
import os

import torch


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def agreeing_tokens(want, got) -> tuple[int, int]:
    """Greedy token streams (lists, or dicts of lists by request): (tokens equal before each stream's first
    difference, all tokens of `want`)."""
    if isinstance(want, dict):
        want, got = list(want.values()), [got[k] for k in want]
    same = sum(next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w)) for w, g in zip(want, got))
    return same, sum(len(w) for w in want)


def hang_watchdog(seconds: float) -> None:
    """If the script still runs after `seconds`: print every process's Python stack (this one's, then the
    spawned ranks' through SIGABRT, which faulthandler turns into a traceback) and exit 3. A hung NCCL
    collective otherwise ends a device call with no output at all."""
    import faulthandler
    import multiprocessing
    import os
    import signal
    import sys
    import threading
    import time

    os.environ["PYTHONFAULTHANDLER"] = "1"   # inherited by the ranks spawned after this call
    faulthandler.enable()

    def fire():
        time.sleep(seconds)
        print(f"\n=== hang watchdog: still running after {seconds:.0f} s; stacks follow ===", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGABRT)
        time.sleep(3)
        sys.stdout.flush()
        os._exit(3)

    threading.Thread(target=fire, daemon=True).start()


@contextlib.contextmanager
def row_graphs_off(engine):
    """The engine's eager prefill steps without row-wise graphs inside (engine/row_graphs.py), as --graph-prefill-max
    0 would run them."""
    held = engine.runner.row_graphs
    engine.runner.row_graphs = None
    try:
        yield
    finally:
        engine.runner.row_graphs = held


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """These environment variables set inside, the caller's values back after. Only switches read when a kernel is
    launched or a graph captured take effect this way (ops/pdl.py's FLASHNEXT_PDL, ops/branches.py's
    FLASHNEXT_DECODE_BRANCHES), not those read once at import."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def pdl_off():
    """Programmatic dependent launch off inside (ops/pdl.py reads FLASHNEXT_PDL at each launch: capture or time
    inside)."""
    return environment({"FLASHNEXT_PDL": "0"})
