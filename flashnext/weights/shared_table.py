"""One host copy of a large table for every rank of one host (the PLE n-gram table: 102 GB in bf16).

Each rank of a tensor/expert-parallel group computes the replicated layers itself and so reads PLE rows, but
only rank 0 reads the table from the checkpoint: into a file under `--ple-share-dir` (/dev/shm by default: RAM)
that it maps shared, first saying whether it could (`TableShare.begin`: room in the directory), and marks it
ready when it is filled (`after_load`). The other ranks skip the table while loading, then map the same file
(the same physical pages) and say so. Once every rank has mapped it, rank 0 unlinks the file (`finish`): the
mappings live on, and the memory is freed with the last of them, also when a rank crashes. Each rank pins its
own mapping for the GPU's gather (weights/pinned.py; the pages are shared, the registration per process).

Files are named `flashnext-ple-<rank 0's pid>-<port>`; files of a rank 0 that no longer runs are deleted when
a new one is created (so is the decision file of a launch that kept private copies: no rank says when all have
read it). Without room in the directory the caller falls back to one private copy per rank.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("flashnext.weights")

PREFIX = "flashnext-ple-"
POLL_S = 0.2


def share_path(directory, rank0_pid: int, port: int) -> Path:
    return Path(directory) / f"{PREFIX}{rank0_pid}-{port}"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(directory: Path) -> None:
    for path in directory.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not process_alive(pid):
            path.unlink(missing_ok=True)
            log.info("removed %s, left by a server that no longer runs", path)


def _map(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def _create(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zero-filled shared mapping of the table's size, or None (with a warning) when the directory lacks the
    room (docker's /dev/shm is 64 MB unless the container has --ipc=host or --shm-size)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path.parent)
    nbytes = math.prod(shape) * dtype.itemsize
    stat = os.statvfs(path.parent)
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes:
        log.warning("the %.1f GB PLE table cannot be shared between ranks: %s has %.1f GB free; every rank keeps "
                    "its own copy (set --ple-share-dir, or give the container more /dev/shm)", nbytes / 1e9,
                    path.parent, free / 1e9)
        return None
    return _map(path, shape, dtype)


def _wait_for(paths: list[Path], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


class TableShare:
    """One rank's part in sharing the host table `key` of the checkpoint through the file `path` (above):
    `begin` before loading says what the loader fills or skips, `after_load` publishes or maps the table,
    `finish` (rank 0, once its loading is done) unlinks the files when every rank has mapped them."""

    def __init__(self, path, key: str, shape: tuple[int, ...], dtype: torch.dtype, rank: int, world: int,
                 timeout_s: float = 3600.0):
        self.path, self.key, self.shape, self.dtype = Path(path), key, tuple(shape), dtype
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.shared = False

    def _mark(self, suffix: str) -> Path:
        return Path(f"{self.path}.{suffix}")

    def begin(self) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """→ (tensors for load_checkpoint's `into`, names for its `not_read`)."""
        decided = self._mark("decided")   # rank 0 writes "shared" or "private" here; the workers wait for it
        if self.rank == 0:
            table = _create(self.path, self.shape, self.dtype)
            self.shared = table is not None
            tmp = self._mark("deciding")
            tmp.write_text("shared" if self.shared else "private")
            tmp.replace(decided)
            return ({self.key: table} if self.shared else {}), frozenset()
        _wait_for([decided], self.timeout_s, f"rank 0 did not decide how to hold {self.path}")
        self.shared = decided.read_text() == "shared"
        return {}, (frozenset({self.key}) if self.shared else frozenset())

    def after_load(self, weights: dict) -> None:
        if not self.shared:
            return
        if self.rank == 0:
            self._mark("ready").touch()
            return
        _wait_for([self._mark("ready")], self.timeout_s, f"rank 0 did not fill the shared PLE table {self.path}")
        weights[self.key] = _map(self.path, self.shape, self.dtype)
        self._mark(f"mapped{self.rank}").touch()
        log.info("rank %d maps rank 0's PLE table (%s)", self.rank, self.path)

    def discard(self) -> None:
        """Rank 0, its load failed: unlink the files now (a worker that mapped the table keeps its mapping)."""
        if self.rank == 0:
            for p in (self.path, self._mark("decided"), self._mark("ready"),
                      *(self._mark(f"mapped{r}") for r in range(1, self.world))):
                p.unlink(missing_ok=True)

    def finish(self) -> None:
        if self.rank != 0 or not self.shared:
            return
        mapped = [self._mark(f"mapped{r}") for r in range(1, self.world)]
        _wait_for(mapped, self.timeout_s, f"not every rank mapped the shared PLE table {self.path}")
        self.discard()
        log.info("the %d ranks share one copy of the PLE table", self.world)
