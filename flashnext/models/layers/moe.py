"""Sparse MoE with a shared expert: fp32 softmax router, top-k (renormalised), experts as fused 3-D
weights (gate_up [E, 2I, H], down [E, H, I]), plus sigmoid(shared_expert_gate · x) × shared expert."""
import torch
import torch.nn.functional as F
from torch import nn

from flashnext.ops import branches
from flashnext.ops.gated_elementwise import gated_add, silu_mul
from flashnext.ops.moe_int4 import SharedExpert
from flashnext.ops.router_topk import router_topk
from flashnext.weights.config import ModelConfig


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = None  # gate and up in one GEMM once the model is loaded (models/stacked.py)

    def forward(self, x):
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(silu_mul(gate, up))

    decode = forward  # row-wise already: nothing to change for a captured decode step


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.trace = None  # a CalibratedRouting (cache/routing_trace.py): benchmarks' stated-locality routing

    def forward(self, x, decode: bool = False):
        """→ (weights [N, k] in x's dtype, expert ids [N, k])."""
        return self.select(F.linear(x, self.weight), decode)

    def select(self, logits, decode: bool = False):
        """Routing from the logits: the top-k of their softmax — or, with a trace installed, the trace's experts
        with their softmax weights (renormalised the same way); `decode`: a decode step, which may be captured
        (the trace's ids then come from a table on the device: CalibratedRouting.decode_ids)."""
        if self.trace is None:
            return router_topk(logits, self.top_k, self.normalize)
        draw = self.trace.decode_ids if decode else self.trace.ids
        ids = draw(logits.shape[0], logits.device)
        top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x, weights, ids):
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def decode(self, x, weights, ids):
        """Graph-safe form for a few rows: gather each (row, slot)'s expert weights, batched matmuls, sum over
        slots. It reads every chosen expert once per row, fine for decode; INT4 experts have fused kernels."""
        gate, up = torch.einsum("bh,bkoh->bko", x, self.gate_up_proj[ids]).chunk(2, dim=-1)
        y = torch.einsum("bki,bkhi->bkh", F.silu(gate) * up, self.down_proj[ids])
        return (y * weights[..., None]).sum(dim=1).to(x.dtype)

    def shared_int4(self, shared_expert: DenseMLP, x):
        """16-bit experts do not run the shared expert themselves (Int4Experts.shared_int4 can)."""
        return None


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.route_and_gate = None  # router and shared-expert gate in one GEMM once loaded (models/stacked.py)

    def forward(self, x):
        weights, ids, shared_gate = self._route(x)
        return gated_add(self.experts(x, weights, ids), self.shared_expert(x), shared_gate)

    def decode(self, x):
        shared = self.experts.shared_int4(self.shared_expert, x)
        if shared is not None:   # the INT4 kernels run the shared expert as one more expert: no launches of its own
            weights, ids, shared_gate = self._route(x, decode=True)
            return self.experts.decode(x, weights, ids, SharedExpert(*shared, shared_gate))
        # the shared expert needs only x: a parallel branch of the decode graph (ops.branches)
        (routed, shared_gate), shared = branches.parallel(x, lambda: self._routed_decode(x),
                                                          lambda: self.shared_expert(x))
        return gated_add(routed, shared, shared_gate)

    def _routed_decode(self, x):
        weights, ids, shared_gate = self._route(x, decode=True)
        return self.experts.decode(x, weights, ids), shared_gate

    def _route(self, x, decode: bool = False):
        """→ routing weights [N, k], expert ids [N, k], shared-expert gate logit [N, 1]."""
        if self.route_and_gate is None:
            return *self.gate(x, decode), self.shared_expert_gate(x)
        logits, shared_gate = self.route_and_gate(x)
        return *self.gate.select(logits, decode), shared_gate
