"""GatedDeltaNet token mixer (linear attention with a gated delta-rule state).

Projections come in two checkpoint layouts: split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`;
Qwen3.5 / Flash-Next) and fused per key-head group (`in_proj_qkvz` viewed as groups of
[q | k | v·r | z·r], `in_proj_ba` as [b·r | a·r] with r = value heads per key head; Qwen3-Next).
State per sequence: the conv tail and the fp32 S matrix, in the StatePool slot.
"""
import torch
import torch.nn.functional as F
from torch import nn

from flashnext.models.context import ForwardContext
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers.norms import GatedRMSNorm
from flashnext.ops import branches
from flashnext.ops.causal_conv1d import causal_conv1d
from flashnext.ops.gdn_decode import gdn_decode
from flashnext.ops.gated_delta_rule import CHUNKED_MIN, gated_delta_rule
from flashnext.weights.config import ModelConfig


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.split = cfg.gdn_split_projections
        hidden = cfg.hidden_size
        if self.split:
            self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
            self.project_ba = None    # b and a in one GEMM once the model is loaded (models/stacked.py)
            self.project_qkvz = None  # qkv and z likewise
        else:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel, groups=conv_dim, bias=False,
                                padding=cfg.linear_conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.rms_norm_eps, activation=cfg.gdn_output_gate)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _project(self, x: torch.Tensor):
        """→ mixed qkv [N, conv_dim] as [all q | all k | all v], z [N, Hv, Dv], b and a [N, Hv]."""
        # the projections of one input: parallel branches of the decode graph (ops.branches)
        (mixed, z), (b, a) = branches.parallel(x, lambda: self._project_qkvz(x), lambda: self._project_ba(x))
        return mixed, z, b, a

    def _project_qkvz(self, x: torch.Tensor):
        n = x.shape[0]
        if self.split:
            mixed, z = self.project_qkvz(x) if self.project_qkvz is not None else (self.in_proj_qkv(x),
                                                                                  self.in_proj_z(x))
            return mixed, z.view(n, self.num_v_heads, self.head_v_dim)
        r = self.num_v_heads // self.num_k_heads
        q, k, v, z = torch.split(self.in_proj_qkvz(x).view(n, self.num_k_heads, -1),
                                 [self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, self.num_v_heads, self.head_v_dim)

    def _project_ba(self, x: torch.Tensor):
        if self.split:
            return self.project_ba(x) if self.project_ba is not None else (self.in_proj_b(x), self.in_proj_a(x))
        n, r = x.shape[0], self.num_v_heads // self.num_k_heads
        b, a = torch.split(self.in_proj_ba(x).view(n, self.num_k_heads, 2 * r), [r, r], dim=-1)
        return b.reshape(n, -1), a.reshape(n, -1)

    def _decay_and_beta(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (log decay g [N, Hv] fp32, beta [N, Hv])."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _segment(self, mixed, g, beta, conv_tail, ssm):
        """One sequence's rows in order: conv from its tail, then the delta rule from its state S.
        → (o [T, Hv, Dv], new conv tail, new S)."""
        n = mixed.shape[0]
        qkv, conv_tail = causal_conv1d(mixed, self.conv1d.weight.squeeze(1), conv_tail)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        o, ssm = gated_delta_rule(q.reshape(n, self.num_k_heads, self.head_k_dim),
                                  k.reshape(n, self.num_k_heads, self.head_k_dim),
                                  v.reshape(n, self.num_v_heads, self.head_v_dim), g, beta, ssm)
        return o, conv_tail, ssm

    def _gated_out(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        n = o.shape[0]
        out = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(n, self.value_dim))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mixed, z, g, beta = ctx.rows("gdn_in", self._prefill_inputs, x)
        conv_state, ssm_state = ctx.states.conv[self.layer_idx], ctx.states.ssm[self.layer_idx]
        out = ctx.sequence("gdn_mix", lambda *a: self._padded_segment(conv_state, ssm_state, *a), mixed, g, beta)
        if out is None:
            out = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
            for seg in ctx.segments:
                rows = slice(seg.start, seg.end)
                out[rows], conv_state[seg.slot], ssm_state[seg.slot] = self._segment(
                    mixed[rows], g[rows], beta[rows], conv_state[seg.slot], ssm_state[seg.slot])
        return ctx.rows("gdn_out", self._gated_out, out, z)

    def _padded_segment(self, conv_state, ssm_state, mixed, g, beta, where):
        """One sequence's rows padded past its length (where = [slot, length] on the device, models/context.py
        ForwardContext.sequence): rows past the length decay by nothing (g 0) and write nothing (beta 0), so the
        delta rule's state is the real rows' alone; the new conv tail is the inputs before the length."""
        slot, length = where[:1], where[1]
        valid = (torch.arange(mixed.shape[0], device=mixed.device) < length)[:, None]
        g, beta = torch.where(valid, g, 0.0), torch.where(valid, beta, 0.0)
        tail = conv_state.index_select(0, slot)[0]
        o, _, ssm = self._segment(mixed, g, beta, tail, ssm_state.index_select(0, slot)[0])
        span = torch.arange(tail.shape[0], device=mixed.device)
        conv_state.index_copy_(0, slot, torch.cat([tail.to(mixed.dtype), mixed]).index_select(0, length + span)[None]
                               .to(conv_state.dtype))
        ssm_state.index_copy_(0, slot, ssm[None].to(ssm_state.dtype))
        return o

    def _prefill_inputs(self, x: torch.Tensor):
        """The row-wise part before the conv and the delta rule: → (mixed qkv, z, g, beta)."""
        mixed, z, b, a = self._project(x)
        return mixed, z, *self._decay_and_beta(b, a)

    def decode(self, x: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per row: conv, delta rule and gated norm fused in ops.gdn_decode (states updated in place). A
        chained batch (one sequence's tokens) of CHUNKED_MIN rows or more runs as a prefill segment of its slot (the
        chunked delta rule; the slot read and written by device index); a shorter one row by row through the decode
        kernels (the torch recurrence a short segment takes costs ~10 launches a token over the whole state)."""
        mixed, z, b, a = self._project(x)
        if batch.chained and batch.size >= CHUNKED_MIN:
            g, beta = self._decay_and_beta(b, a)
            conv_state, ssm_state = batch.states.conv[self.layer_idx], batch.states.ssm[self.layer_idx]
            o, conv_tail, ssm = self._segment(mixed, g, beta, batch.chain_state(conv_state), batch.chain_state(ssm_state))
            batch.set_chain_state(conv_state, conv_tail)
            batch.set_chain_state(ssm_state, ssm)
            return self._gated_out(o, z)
        steps = [slice(i, i + 1) for i in range(batch.size)] if batch.chained else [slice(None)]
        out = [gdn_decode(mixed[rows], z[rows], b[rows], a[rows], batch.states.conv[self.layer_idx],
                          self.conv1d.weight.squeeze(1), batch.states.ssm[self.layer_idx], batch.slots[rows], self.A_log,
                          self.dt_bias, self.norm.weight, num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
                          num_v_heads=self.num_v_heads, head_v_dim=self.head_v_dim, eps=self.norm.eps,
                          activation=self.norm.activation) for rows in steps]
        return self.out_proj(out[0] if len(out) == 1 else torch.cat(out))
