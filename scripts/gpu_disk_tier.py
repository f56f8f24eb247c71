"""On the GPU host: how fast the disk tier gives a conversation's KV blocks back (DiskStore.load_blocks), out of the
page cache and cold (each file dropped from the page cache with posix_fadvise first: no privileges, no system
setting touched), against the disk's own sequential read of the same bytes. Blocks of Flash-Next's shapes (12
attention layers: K and V [16, 2, 256] bf16 and the indexer's keys [16, 128] bf16 each, ~442 KB a block),
written as the tier writes them (batches of WRITE_PIECE blocks). BENCHMARKS.md session 10 has why.
Run: python3 scripts/gpu_disk_tier.py [--blocks 3625] [--dir /tmp/fn-disk-tier]"""
import argparse
import os
import shutil
import time
from pathlib import Path

import torch

from flashnext.cache import disk_tier
from flashnext.cache.cache_entry import WRITE_PIECE
from flashnext.cache.disk_tier import DiskStore

SHAPES = {**{f"k.{i}": (16, 2, 256) for i in range(12)}, **{f"v.{i}": (16, 2, 256) for i in range(12)},
          **{f"index.{i}": (16, 128) for i in range(12)}}


def drop_from_page_cache(directory: Path) -> None:
    for path in directory.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(directory: Path) -> float:
    start = time.perf_counter()
    for path in sorted(directory.rglob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=3625, help="blocks of one conversation (3,625: 58K tokens)")
    ap.add_argument("--dir", default="/tmp/fn-disk-tier", help="scratch directory (deleted at the end)")
    args = ap.parse_args()
    directory = Path(args.dir)
    shutil.rmtree(directory, ignore_errors=True)
    store = DiskStore(directory, "bench")
    hashes = [os.urandom(32) for _ in range(args.blocks)]
    g = torch.Generator().manual_seed(0)
    for at in range(0, args.blocks, WRITE_PIECE):
        piece = hashes[at: at + WRITE_PIECE]
        store.store_blocks(piece, {name: torch.randn(len(piece), *shape, generator=g).bfloat16()
                                   for name, shape in SHAPES.items()})
    store.flush()
    size = sum(p.stat().st_size for p in directory.rglob("*.safetensors"))
    files = len(list(directory.rglob("*.safetensors")))
    print(f"{args.blocks} blocks, {size / 1e9:.2f} GB in {files} files; {disk_tier.READERS} reader threads")
    drop_from_page_cache(directory)
    print(f"sequential read, cold: {size / sequential_read(directory) / 1e9:.2f} GB/s")
    for label in ("cold", "page cache"):
        if label == "cold":
            drop_from_page_cache(directory)
        start = time.perf_counter()
        runs = store.load_blocks(hashes)
        seconds = time.perf_counter() - start
        rows = sum(next(iter(run.values())).shape[0] for run in runs)
        assert rows == args.blocks
        print(f"load_blocks, {label}: {seconds:.2f} s, {size / seconds / 1e9:.2f} GB/s ({len(runs)} runs)")
        del runs
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
