"""The two modules sharding puts into a model: the only places where ranks talk during a forward.

Both wrap the sharded module rather than edit the layer files: model code stays single-device, and
`print(model)` shows where the sums happen. A module swapped inside them later (e.g. `--quantize int4`
replacing a projection or the experts after sharding) keeps its sum.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ReducedOutput(nn.Module):
    """A token mixer whose heads are split over ranks: its row-parallel output projection gives each rank a
    partial sum of the output, summed here (one all-reduce per layer)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args):
        out = self.inner(*args)
        dist.all_reduce(out, group=self.group)
        return out

    def decode(self, *args):
        out = self.inner.decode(*args)
        dist.all_reduce(out, group=self.group)
        return out


class LocalExperts(nn.Module):
    """Routed experts [first, first + count) of this rank; same call as `layers.moe.Experts`
    (x [N, H], weights [N, k], global ids [N, k]) → the weighted sum over all experts, on every rank.

    Each (token, choice) pair routed here becomes its own row with top-1, so the wrapped experts (fp or INT4
    kernels) never see an id outside their range; the rows are added back per token, then summed over ranks."""

    def __init__(self, inner: nn.Module, first: int, count: int, group):
        super().__init__()
        self.inner = inner
        self.first, self.count = first, count
        self.group = group

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        token, choice = torch.where((local >= 0) & (local < self.count))
        out = torch.zeros_like(x)
        if token.numel():
            y = self.inner(x[token], weights[token, choice, None], local[token, choice, None])
            out.index_add_(0, token, y)
        dist.all_reduce(out, group=self.group)
        return out

    def decode(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Fixed shapes for the captured decode step (no data-dependent selection, no host sync): choices routed
        to other ranks keep their row with weight 0 and an id clamped into this rank's range, which the INT4 decode
        kernels skip (nothing read) and an expert cache's claims do not count (ops/moe_int4_decode_triton.py,
        ops/expert_claims.py); 16-bit experts compute them times 0."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        out = self.inner.decode(x, weights * mine, local.clamp(0, self.count - 1))
        dist.all_reduce(out, group=self.group)
        return out

    def shared_int4(self, shared_expert, x):
        """None: the shared expert is replicated, and run by this rank's kernels it would be summed once per rank."""
        return None

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.count - 1}"
