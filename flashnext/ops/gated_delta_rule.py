"""Gated delta rule: the recurrence inside GatedDeltaNet, as readable torch references.

Shapes (one sequence): q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state S [Hv, Dk, Dv] fp32.
Value head j reads key head j // (Hv // Hk). Per token, in fp32:
    S ← exp(g)·S;  δ = β·(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀ q
with q, k l2-normalised and q scaled by Dk^-½. Two equal formulations: `recurrent` (token by token,
cheap for decode) and `chunked` (UT transform over chunks of 64, matmul-friendly for prefill).
"""
import functools
import os

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    groups = v.shape[1] // k.shape[1]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=1)
        k = k.repeat_interleave(groups, dim=1)
    q, k, v, g, beta = (x.float().transpose(0, 1).contiguous() for x in (q, k, v, g, beta))
    q = l2norm(q)
    k = l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta  # heads first: [H, T, D], g/beta [H, T]


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """Returns (o [T, Hv, Dv] in v's dtype, new state [Hv, Dk, Dv] fp32)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        kv_mem = (s * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (s * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1).to(out_dtype), s


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """Same result as the recurrent form; within a chunk the delta-rule updates are solved at once."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    seq_len = v.shape[1]
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, total = v.shape[0], v.shape[1]
    n = total // chunk_size

    def chunks(x):
        return x.reshape(heads, n, chunk_size, *x.shape[2:])

    k_beta = chunks(k * beta[..., None])
    v_beta = chunks(v * beta[..., None])
    q, k, g = chunks(q), chunks(k), chunks(g)
    cum = g.cumsum(dim=-1)                                   # log decay from chunk start to t (inclusive)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).triu(1)
    # decay between positions j ≤ i of a chunk; masked before exp so nothing overflows
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    # (I + strictly-lower(ut)) x = rhs, the UT transform of the chunk's delta-rule updates
    system = ut.masked_fill(~torch.ones_like(upper).tril(-1), 0) + torch.eye(chunk_size, device=v.device)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)

    s = state.float().clone()
    out = torch.empty_like(new_values)
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, total, -1)[:, :seq_len]
    return out.transpose(0, 1).to(out_dtype), s


@functools.cache
def _fla_chunk():
    """fla-core's chunked kernel (Triton, GPU only) when installed and not switched off with
    FLASHNEXT_GDN_PREFILL=reference; None otherwise."""
    if os.environ.get("FLASHNEXT_GDN_PREFILL", "fla") == "reference":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gated_delta_rule_fla(q, k, v, g, beta, state):
    """The chunked form through fla-core (`pip install fla-core`): same contract as the references. fla
    l2-normalises q and k in its kernel, scales q by Dk^-½, maps value head j to key head j // (Hv/Hk) (its
    grouped-value layout) and keeps the state in fp32."""
    chunk = _fla_chunk()
    o, final = chunk(q[None], k[None], v[None], g.float()[None], beta[None].to(v.dtype), scale=q.shape[-1] ** -0.5,
                     initial_state=state.float()[None].contiguous(), output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
    return o[0].to(v.dtype), final[0].float()


CHUNKED_MIN = 16   # gated_delta_rule's shortest input for the chunked form


def gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """Picks the form the way fla's layers do: token by token for short inputs, chunked otherwise — on a GPU
    through fla-core when it is installed (docs/architecture.md), else the torch reference."""
    if v.shape[0] < CHUNKED_MIN:
        return gated_delta_rule_recurrent(q, k, v, g, beta, state)
    if v.is_cuda and _fla_chunk() is not None:
        return gated_delta_rule_fla(q, k, v, g, beta, state)
    return gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size)
