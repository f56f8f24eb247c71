"""What the prefix cache tiers hold and exchange: KV block contents and state snapshots, named by hashes.

A block is named by a chained hash of every token up to its end, so equal names mean equal prefixes; a
snapshot by the name of its last full block plus the tail tokens after it. Names are stable across
processes (blake2b, not Python's `hash`), so the disk tier finds its entries again after a restart.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

import torch

ROOT_HASH = bytes(16)


def block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def snapshot_key(last_block: bytes, tail) -> bytes:
    return hashlib.blake2b(b"snapshot" + last_block + array("q", tail).tobytes(), digest_size=16).digest()


def chain_hashes(tokens, block_size: int, num_blocks: int) -> list[bytes]:
    """[root, hash of block 1, …, hash of block num_blocks]: index d names the prefix of d blocks."""
    out = [ROOT_HASH]
    for i in range(num_blocks):
        out.append(block_hash(out[-1], tokens[i * block_size:(i + 1) * block_size]))
    return out


def read_block(kv, block: int) -> dict[str, torch.Tensor]:
    """Views of one KV block in every attention layer (K, V and the indexer's pooled keys)."""
    out = {}
    for group in ("k", "v", "index_keys"):
        for layer, t in getattr(kv, group).items():
            out[f"{group}.{layer}"] = t[block]
    return out


def write_block(kv, block: int, data: dict[str, torch.Tensor]) -> None:
    for group in ("k", "v", "index_keys"):
        for layer, t in getattr(kv, group).items():
            t[block].copy_(data[f"{group}.{layer}"], non_blocking=True)


def tensor_bytes(tensors: dict[str, torch.Tensor] | None) -> int:
    return sum(t.numel() * t.element_size() for t in (tensors or {}).values())


def copy_tensors(tensors: dict[str, torch.Tensor], device, pin: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        c = t.to(device, copy=True)
        out[name] = c.pin_memory() if pin else c
    return out


@dataclass
class Snapshot:
    """The recurrent state of a sequence after `num_tokens` tokens, plus the KV of its partial last block.

    Only full KV blocks are shared between sequences (a sequence writes into its last block). When the
    snapshot position is not block-aligned, the partial block's contents travel with the snapshot
    (`tail_kv`, one block) and are copied into a fresh block of the sequence that resumes from it.
    """
    num_tokens: int
    tail: tuple[int, ...]                       # tokens after the last full block
    state: dict[str, torch.Tensor]              # StatePool.snapshot of the slot
    tail_kv: dict[str, torch.Tensor] | None     # read_block of the partial block; None when aligned

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.state) + tensor_bytes(self.tail_kv)

    def to(self, device, pin: bool = False) -> Snapshot:
        tail_kv = copy_tensors(self.tail_kv, device, pin) if self.tail_kv is not None else None
        return Snapshot(self.num_tokens, self.tail, copy_tensors(self.state, device, pin), tail_kv)
