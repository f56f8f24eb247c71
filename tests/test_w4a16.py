"""INT4 kernel layout and W4A16 matmul: layout helpers against the GPTQ helpers, the reference against plain
dequantise + matmul, and the Triton kernels (CPU: TRITON_INTERPRET=1) against the reference at odd sizes."""
import importlib.util

import pytest
import torch

from flashnext.weights.int4 import dequantize_gptq, quantize_gptq_rtn
from flashnext.weights.int4_layout import Int4Weight, dequantize, from_gptq, quantize_rtn
from flashnext.ops.w4a16 import w4a16_linear, w4a16_linear_reference


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def make_weight(n, k, g, kind, seed=0):
    """kind: rtn (ours, symmetric), sym / asym (a GPTQ checkpoint), act (asym with act-order g_idx).
    Returns the Int4Weight and what dequantize_gptq makes of the checkpoint (None for rtn)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    if kind == "rtn":
        return quantize_rtn(weight, g), None
    perm = torch.randperm(k, generator=gen) if kind == "act" else None
    ckpt = quantize_gptq_rtn(weight, g, sym=kind == "sym", desc_act_perm=perm)
    w = from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt.get("g_idx"), sym=kind == "sym")
    return w, dequantize_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt.get("g_idx"))


@pytest.mark.parametrize("kind", ["sym", "asym", "act"])
def test_from_gptq_dequantises_like_the_checkpoint(kind):
    w, want = make_weight(96, 384, 128, kind)
    assert torch.equal(dequantize(w), want)
    assert (w.zeros is None) == (kind == "sym")
    assert (w.perm is not None) == (kind == "act")


def test_symmetric_gptq_needs_no_repacking():
    ckpt = quantize_gptq_rtn(torch.randn(64, 256), 64, sym=True)
    w = from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], None, sym=True)
    assert w.qweight is ckpt["qweight"] or torch.equal(w.qweight, ckpt["qweight"])
    assert w.zeros is None and w.perm is None and w.scales.dtype == torch.float16


def test_from_gptq_refuses_uneven_act_order_groups():
    ckpt = quantize_gptq_rtn(torch.randn(64, 256), 64, sym=True)
    g_idx = torch.zeros(256, dtype=torch.int32)
    g_idx[200:] = 3
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], g_idx, sym=True)


def test_from_gptq_zero_conventions():
    # gptq v1 stores zero - 1 with a 4-bit wrap (a stored 15 is a zero of 16); gptq v2 stores the zero itself.
    from flashnext.weights.int4 import pack_int32
    qweight = pack_int32(torch.full((64, 8), 3), 4, dim=0)
    scales = torch.ones(1, 8, dtype=torch.float16)
    v1 = from_gptq(qweight, pack_int32(torch.full((1, 8), 15), 4, dim=1), scales, None, sym=False)
    assert int(v1.zeros.max()) == 16 and bool((dequantize(v1) == -13).all())
    v2 = from_gptq(qweight, pack_int32(torch.full((1, 8), 8), 4, dim=1), scales, None, sym=True, zeros_minus_one=False)
    assert v2.zeros is None and bool((dequantize(v2) == -5).all())
    with pytest.raises(ValueError, match="symmetric"):
        from_gptq(qweight, pack_int32(torch.full((1, 8), 3), 4, dim=1), scales, None, sym=True)


def test_quantize_rtn_is_close_and_stable():
    weight = torch.randn(160, 384)
    w = quantize_rtn(weight, 128)
    assert w.qweight.shape == (48, 160) and w.scales.shape == (3, 160) and w.scales.dtype == torch.bfloat16
    deq = dequantize(w)
    # Symmetric RTN: the error of each weight is at most half a step (amax / 14) of its group.
    step = w.scales.float().repeat_interleave(128, 0).t()
    assert bool(((deq - weight).abs() <= step / 2 + 1e-6).all())
    again = quantize_rtn(deq, 128)
    assert torch.equal(again.qweight, w.qweight) and torch.equal(dequantize(again), deq)


@pytest.mark.parametrize("kind", ["rtn", "asym", "act"])
def test_reference_equals_dequantise_then_matmul(kind):
    w, _ = make_weight(160, 256, 64, kind)
    x = torch.randn(5, 256, dtype=torch.float64).float()
    want = x.double() @ dequantize(w).double().t()
    assert rel_err(w4a16_linear_reference(x, w), want) < 1e-6
    xb = x.bfloat16()
    got = w4a16_linear(xb, w)
    assert got.dtype == torch.bfloat16 and rel_err(got, xb.double() @ dequantize(w).double().t()) < 1e-2


def test_stacked_experts_dequantise_per_expert():
    ws = [make_weight(96, 256, 64, "act", seed=s)[0] for s in range(3)]
    stacked = Int4Weight(torch.stack([w.qweight for w in ws]), torch.stack([w.scales for w in ws]),
                         torch.stack([w.zeros for w in ws]), torch.stack([w.perm for w in ws]), 64)
    assert torch.equal(dequantize(stacked), torch.stack([dequantize(w) for w in ws]))


# --- Triton kernels (interpreted on CPU) ---------------------------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not importable (pip install triton)")


@pytest.fixture(scope="module")
def kernels():
    from flashnext.ops import w4a16_triton
    return w4a16_triton


CASES = [  # (M, N, K, g, kind)
    (1, 96, 256, 64, "rtn"), (1, 160, 384, 128, "act"),
    (3, 160, 256, 128, "asym"), (3, 96, 384, 64, "act"),
    (17, 96, 384, 128, "rtn"), (17, 160, 256, 64, "act"),
]


@needs_triton
@pytest.mark.parametrize("m,n,k,g,kind", CASES)
def test_triton_matches_reference(kernels, m, n, k, g, kind):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, _ = make_weight(n, k, g, kind, seed=m)
    w = w.to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)).to(device)
    got = kernels.w4a16_matmul(x, w)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert rel_err(got, w4a16_linear_reference(x, w)) < 1e-5


@needs_triton
@pytest.mark.parametrize("split_k,block_m,in_tile", [(1, 1, False), (3, 16, False), (2, 16, True)])
def test_triton_split_and_tile_choices_agree(kernels, split_k, block_m, in_tile):
    # The GEMM kernel forced at decode sizes (its no-dot mode at block_m < 16): the benchmark's baseline.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, _ = make_weight(96, 384, 64, "asym", seed=7)
    w = w.to(device)
    cfg = kernels.LaunchConfig(block_m=block_m, block_n=32, block_k=32, split_k=split_k, scale_in_tile=in_tile)
    for rows in (2, 37):    # one M block, and several (a counter per M and N block)
        x = torch.randn(rows, 384).to(device)
        got = kernels.w4a16_matmul(x, w, cfg)
        assert rel_err(got, w4a16_linear_reference(x, w)) < 1e-5
        # the splits summed in one order (meaningful on a GPU, where programs run at once; run by gpu_w4a16.py)
        assert torch.equal(kernels.w4a16_matmul(x, w, cfg), got)
    assert kernels.w4a16_matmul(x[:0], w).shape == (0, 96)
    from flashnext.ops.arrival import buffers   # the split tiles' last programs left their counters at zero

    assert all(int(counters.abs().sum()) == 0 for counters in buffers(x.device))


GEMV_CASES = [  # (M, N, K, g, kind, GemvConfig fields or None for the heuristic)
    (1, 72, 96, 32, "rtn", None), (1, 200, 256, 128, "act", None),
    (3, 200, 96, 32, "asym", (64, 32, 3)), (3, 72, 256, 128, "act", (32, 64, 4)),
    (8, 72, 256, 128, "asym", None), (8, 200, 96, 32, "act", (128, 16, 6)),
    (1, 200, 256, 128, "rtn", (64, 128, 1)),
    # tensor-core mode: M padded to 16, K tiles of 128
    (3, 200, 256, 128, "asym", (64, 128, 2, True)), (8, 72, 256, 128, "act", (32, 128, 1, True)),
    (1, 72, 384, 128, "rtn", (32, 128, 3, True)),
    # K tiles of several groups (each word row scaled by its own group), zeros and act-order included
    (1, 200, 256, 32, "asym", (64, 128, 2)), (2, 72, 256, 32, "act", (32, 256, 1)), (4, 200, 512, 64, "rtn", (32, 256, 2)),
]


@needs_triton
@pytest.mark.parametrize("m,n,k,g,kind,fields", GEMV_CASES)
def test_gemv_matches_reference(kernels, m, n, k, g, kind, fields):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, _ = make_weight(n, k, g, kind, seed=m + n)
    w = w.to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)).to(device)
    cfg = kernels.GemvConfig(*fields) if fields else kernels.gemv_config(m, n, k, g, x.device)
    got = kernels.w4a16_matmul(x, w, cfg)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert rel_err(got, w4a16_linear_reference(x, w)) < 1e-5
    # The last program of each column block leaves its counter at zero for the next call (no memset).
    from flashnext.ops.arrival import buffers

    for counters in buffers(x.device):
        assert int(counters.abs().sum()) == 0


@needs_triton
def test_gemv_dispatch_and_split_rule(kernels):
    dev = torch.device("cpu")
    w, _ = make_weight(72, 256, 128, "asym", seed=5)
    for m in (1, 8):
        cfg = kernels.gemv_config(m, 72, 256, 128, dev)
        # a small shape still gets split K (8 "SMs" on CPU) so that every SM has programs
        assert cfg.split_k > 1 and 256 % cfg.block_k == 0 and 128 % cfg.block_k == 0
    x = torch.randn(8, 256)
    rows = [kernels.w4a16_matmul(x[i:i + 1], w) for i in range(8)]
    # per-row calls and one 8-row call agree (a different M bucket may pick another tile: fp32 order only)
    assert rel_err(torch.cat(rows), kernels.w4a16_matmul(x, w)) < 1e-5
    assert kernels.w4a16_matmul(x[:0], w).shape == (0, 72)
    # the same call twice gives the same bits: split-K partials are added in a fixed order
    assert torch.equal(kernels.w4a16_matmul(x[:3], w), kernels.w4a16_matmul(x[:3], w))


@needs_triton
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_triton_half_precision_activations(kernels, m):
    # fp16: M <= 8 takes the GEMV kernel (fp32 fma; at M = 8 and g = 128 its dot mode, (q - z) * 16**-j in
    # fp16: exact), M = 17 the GEMM kernel's dot ((q - z) cast to x's dtype, exact for integers). bf16 is only
    # checked on the GPU (scripts/gpu_w4a16.py): Triton 3.9's interpreter reinterprets the bits of an
    # int → bf16 cast and gets bf16 tl.dot wrong.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, _ = make_weight(96, 256, 128, "act", seed=3)
    w = w.to(device)
    x = torch.randn(m, 256).to(device=device, dtype=torch.float16)
    got = kernels.w4a16_matmul(x, w)
    assert got.dtype == torch.float16 and rel_err(got, w4a16_linear_reference(x, w)) < 2e-3


@needs_triton
@pytest.mark.parametrize("n,k,g,kind", [(96, 256, 64, "rtn"), (160, 384, 128, "act"), (72, 256, 128, "asym")])
def test_dequantize_kernel_equals_the_reference(n, k, g, kind):
    # fp32: scale · (q − zero) is exact, so the kernel's [K, N] is the reference's [N, K] transposed, bit for bit
    from flashnext.ops.int4_dequant_triton import dequantize_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, _ = make_weight(n, k, g, kind, seed=n + k)
    got = dequantize_triton(w.to(device), torch.float32)
    assert got.shape == (k, n) and torch.equal(got.cpu(), dequantize(w).t())


@needs_triton
@pytest.mark.parametrize("kind", ["rtn", "act"])
def test_prefill_sized_matmul_through_the_dequantised_weight(kernels, monkeypatch, kind):
    monkeypatch.delenv("FLASHNEXT_W4A16_PREFILL", raising=False)   # the default from DEQUANT_MIN_M rows
    monkeypatch.setattr(kernels, "DEQUANT_MIN_M", 17)
    from flashnext.ops.int4_dequant_triton import dequantize_triton

    calls = []
    monkeypatch.setattr(kernels, "dequantize_triton", lambda w, dtype: calls.append(dtype) or dequantize_triton(w, dtype))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, _ = make_weight(160, 384, 128, kind, seed=11)
    w = w.to(device)
    x = torch.randn(17, 384, generator=torch.Generator().manual_seed(12)).to(device)
    assert rel_err(kernels.w4a16_matmul(x, w), w4a16_linear_reference(x, w)) < 1e-5
    assert calls == [torch.float32]
    kernels.w4a16_matmul(x[:16], w)     # below DEQUANT_MIN_M: the GEMM kernel
    assert len(calls) == 1
    monkeypatch.setenv("FLASHNEXT_W4A16_PREFILL", "triton")            # the switch keeps the GEMM kernel
    assert rel_err(kernels.w4a16_matmul(x, w), w4a16_linear_reference(x, w)) < 1e-5
    assert len(calls) == 1
