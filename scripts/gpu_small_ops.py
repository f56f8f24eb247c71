"""On the GPU machine: bf16 checks of the small fused ops (RMSNorm, norm + RoPE, router top-k) against their references.
Run: python3 scripts/gpu_small_ops.py"""
import torch, sys
from flashnext.ops.norm_rope import norm_rope_reference
from flashnext.ops.norm_rope_triton import norm_rope_triton
from flashnext.ops.router_topk import router_topk_reference
from flashnext.ops.router_topk_triton import router_topk_triton
from flashnext.models.layers.rope import RotaryEmbedding
ok = True
for rows, heads, dim, rot in [(1, 24, 256, 64), (8, 2, 256, 64), (300, 4, 128, 64)]:
    wide = torch.randn(rows, heads, 2 * dim, device="cuda", dtype=torch.bfloat16)
    x = wide[..., :dim]; w = torch.randn(dim, device="cuda", dtype=torch.bfloat16) * 0.2
    cos, sin = RotaryEmbedding(rot, 1e7)(torch.arange(rows, device="cuda") * 37, torch.bfloat16)
    a = norm_rope_triton(x, w, 1e-6, cos, sin).float(); b = norm_rope_reference(x, w, 1e-6, cos, sin).float()
    err = ((a - b).abs().max() / b.abs().max()).item(); ok &= err < 1e-2
    print(f"norm_rope {rows}x{heads}x{dim} bf16 max rel err {err:.1e}")
for rows in (1, 8, 300):
    logits = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    wt, it = router_topk_triton(logits, 10, True); wr, ir = router_topk_reference(logits, 10, True)
    same = (torch.sort(it, 1).values == torch.sort(ir, 1).values).float().mean().item()
    err = (wt.float().sort(1).values - wr.float().sort(1).values).abs().max().item()
    ok &= same > 0.99 and err < 1e-2
    print(f"router_topk {rows} rows: same experts {same:.3f}, weight err {err:.1e}")
from flashnext.ops.rms_norm import rms_norm_reference
from flashnext.ops.rms_norm_triton import rms_norm_triton
for rows, dim, group in [(1, 2048, None), (8, 2048, None), (300, 10240, 2560), (8192, 2560, None), (8192, 4096, 128)]:
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(dim, device="cuda", dtype=torch.bfloat16) * 0.2
    a = rms_norm_triton(x, w, 1e-6, group).float(); b = rms_norm_reference(x, w, 1e-6, group).float()
    err = ((a - b).abs().max() / b.abs().max()).item(); ok &= err < 1e-2
    print(f"rms_norm {rows}x{dim} group {group} bf16 max rel err {err:.1e}")
from flashnext.ops.qsa_key_append import qsa_key_append_reference
from flashnext.ops.qsa_key_append_triton import qsa_key_append_triton
inv_freq = RotaryEmbedding(64, 1e7).inv_freq.cuda()
slots = torch.tensor([3, 0, 2, 5], device="cuda"); table = torch.randperm(64, device="cuda").view(4, 16)
w = torch.randn(128, device="cuda", dtype=torch.bfloat16) * 0.2
state = {n: (torch.zeros(8, 3, 128, device="cuda", dtype=torch.bfloat16),
             torch.zeros(64, 4, 128, device="cuda", dtype=torch.bfloat16)) for n in ("k", "r")}
positions = torch.tensor([0, 7, 30, 61], device="cuda")
for _ in range(9):
    raw = torch.randn(4, 5 * 128, device="cuda", dtype=torch.bfloat16)[:, 4 * 128:]
    for n, fn in (("k", qsa_key_append_triton), ("r", qsa_key_append_reference)):
        fn(raw, state[n][0], slots, positions, table, state[n][1], w, 1e-6, inv_freq)
    positions = positions + 1
err = max(((state["k"][i].float() - state["r"][i].float()).abs().max() / state["r"][i].float().abs().max()).item()
          for i in (0, 1))
ok &= err < 2e-2
print(f"qsa_key_append bf16 9 steps max rel err {err:.1e}")
from flashnext.ops.gated_elementwise import gated_add_reference, silu_mul_reference
from flashnext.ops.gated_elementwise_triton import gated_add_triton, silu_mul_triton
for rows, n in ((1, 640), (8, 2560)):
    gate, up = (torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16) * 2).split(n, dim=-1)
    shared, logit = torch.randn(rows, n + 1, device="cuda", dtype=torch.bfloat16).split([n, 1], dim=-1)
    routed = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    e1 = ((silu_mul_triton(gate, up).float() - silu_mul_reference(gate, up).float()).abs().max()).item()
    e2 = ((gated_add_triton(routed, shared, logit).float() - gated_add_reference(routed, shared, logit).float())
          .abs().max()).item()
    ok &= e1 < 5e-2 and e2 < 5e-2
    print(f"silu_mul / gated_add {rows}x{n} bf16 max abs err {e1:.1e} / {e2:.1e}")
from flashnext.ops.qsa_scores import qsa_block_scores_reference
from flashnext.ops.qsa_scores_triton import qsa_block_scores_triton
for batch, width in ((1, 4096), (8, 1024)):
    keys = torch.randn(8 * width, 4, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.stack([torch.randperm(8 * width, device="cuda")[:width] for _ in range(batch)])
    q = torch.randn(batch, 4, 128, device="cuda", dtype=torch.bfloat16)
    before = torch.randint(1, width * 4, (batch,), device="cuda")
    a = qsa_block_scores_triton(q, keys, table, before); b = qsa_block_scores_reference(q, keys, table, before)
    fin = ~torch.isinf(b)
    err = ((a[fin] - b[fin]).abs().max() / b[fin].abs().max()).item()
    ok &= err < 1e-3 and torch.equal(torch.isinf(a), torch.isinf(b))
    print(f"qsa_block_scores {batch}x{width * 4} blocks bf16 max rel err {err:.1e}")
from flashnext.ops.hyper_connection import hc_inject, hc_inject_reference, hc_mix, hc_mix_reference
for rows in (300, 3000):  # prefill sizes: the mix through the RMSNorm and combine kernels, inject through its kernel
    h = torch.randn(rows, 4 * 2560, device="cuda", dtype=torch.bfloat16)
    nw, wd = torch.randn(4 * 2560, device="cuda", dtype=torch.bfloat16) * 0.2, torch.randn(320, 4 * 2560, device="cuda", dtype=torch.bfloat16) / 100
    wu, wi = torch.randn(4 * 2560, 320, device="cuda", dtype=torch.bfloat16) / 18, torch.randn(4, 4 * 2560, device="cuda", dtype=torch.bfloat16) / 100
    (a, ia), (b, ib) = hc_mix(h, nw, wd, wu, wi, 4, 2560, 1e-6), hc_mix_reference(h, nw, wd, wu, wi, 4, 2560, 1e-6)
    e1 = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item(), ((ia.float() - ib.float()).abs().max() / ib.float().abs().max()).item())
    out = torch.randn(rows, 2560, device="cuda", dtype=torch.bfloat16)
    # relative to the largest output: one bf16 rounding step apart at |x| ≥ 8 is 6.2e-2 absolute (3,000 rows)
    ref = hc_inject_reference(h, out, ia).float()
    e2 = ((hc_inject(h, out, ia).float() - ref).abs().max() / ref.abs().max()).item()
    ok &= e1 < 2e-2 and e2 < 1e-2
    print(f"hc_mix / hc_inject prefill {rows} rows bf16 max rel err {e1:.1e} / {e2:.1e}")
from flashnext.ops.qsa_scores import qsa_prefill_scores_reference
from flashnext.ops.qsa_scores_triton import qsa_prefill_scores_triton
for length, blocks in [(1024, 2500), (1000, 65536)]:  # the indexer's prefill: 10K and 262K context
    q = torch.randn(length, 4, 128, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(blocks, 128, device="cuda", dtype=torch.bfloat16)
    before = torch.randint(0, blocks + 1, (length,), device="cuda")
    a = qsa_prefill_scores_triton(q, keys, before); b = qsa_prefill_scores_reference(q, keys, before)
    fin = ~torch.isinf(b)
    err = ((a[fin] - b[fin]).abs().max() / b[fin].abs().max()).item()
    ok &= err < 1e-3 and torch.equal(torch.isinf(a), torch.isinf(b))
    print(f"qsa_prefill_scores {length}x{blocks} bf16 max rel err {err:.1e}")
from flashnext.ops.rms_norm import gated_rms_norm_reference
from flashnext.ops.rms_norm_triton import gated_rms_norm_triton
for rows in (48, 8192 * 48):  # GatedDeltaNet's output norm: decode-size and an 8192-token prefill chunk
    x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16) * 3
    gate = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.2 * torch.randn(128, device="cuda")).to(torch.bfloat16)
    a = gated_rms_norm_triton(x, gate, w, 1e-6, "silu").float(); b = gated_rms_norm_reference(x, gate, w, 1e-6, "silu").float()
    err = ((a - b).abs().max() / b.abs().max()).item(); ok &= err < 1e-2
    print(f"gated_rms_norm {rows}x128 bf16 max rel err {err:.1e}")
from flashnext.ops.causal_conv1d import causal_conv1d_reference
from flashnext.ops.causal_conv1d_triton import causal_conv1d_triton
for rows, channels, dilation in [(8192, 10240, 1), (37, 2560, 3)]:  # GDN's conv at a prefill chunk; PLE's dilated one
    x = torch.randn(rows, channels, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(channels, 4, device="cuda") / 2).to(torch.bfloat16)
    tail = torch.randn(3 * dilation, channels, device="cuda", dtype=torch.bfloat16)
    (a, ta), (b, tb) = causal_conv1d_triton(x, w, tail, dilation), causal_conv1d_reference(x, w, tail, dilation)
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item(); ok &= err < 1e-2 and torch.equal(ta, tb)
    print(f"causal_conv1d {rows}x{channels} dilation {dilation} bf16 max rel err {err:.1e}")
print("KERNELS OK" if ok else "KERNEL MISMATCH"); sys.exit(0 if ok else 1)
