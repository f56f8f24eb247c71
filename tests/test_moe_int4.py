"""INT4 routed experts: the Triton kernels (interpreted on CPU) equal the torch reference, and the reference
equals the float Experts module run on the dequantised weights. Odd sizes on purpose; symmetric,
asymmetric and act-order weights; decode blocks and prefill blocks. fp32: the Triton
3.9 interpreter computes tl.dot on bf16 and int->bf16 casts wrongly, so bf16 is checked on the GPU
(scripts/gpu_moe.py)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace

import pytest
import torch

from flashnext.models.layers.moe import Experts
from flashnext.ops.moe_int4 import moe_int4_reference
from flashnext.weights.int4_layout import Int4Weight, dequantize
from oracle import rel_err


def random_int4(e, n, k, group_size, asym=False, act_order=False, seed=0) -> Int4Weight:
    """Stacked random codes with zero-mean (signed) scales; asym adds zeros in 0..16, act_order a perm."""
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31, (e, k // 8, n), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.randn(e, k // group_size, n, generator=g) * 0.05).to(torch.bfloat16)
    zeros = torch.randint(0, 17, (e, k // group_size, n), generator=g).to(torch.uint8) if asym else None
    perm = torch.stack([torch.randperm(k, generator=g) for _ in range(e)]).to(torch.int32) if act_order else None
    return Int4Weight(qweight, scales, zeros, perm, group_size)


def routing(m, e, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    weights = torch.randn(m, k, generator=g)
    return ids, weights


def case(m, e, k, h, i, g_up, g_down, asym=False, act_order=False, seed=0):
    w_gate_up = random_int4(e, 2 * i, h, g_up, asym, act_order, seed)
    w_down = random_int4(e, h, i, g_down, asym, act_order, seed + 1)
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(seed + 2))
    ids, weights = routing(m, e, k, seed + 3)
    return x, ids, weights, w_gate_up, w_down


# (M, k, H, I, g for gate_up (divides H), g for down (divides I), asym, act_order, block_m)
# block_m >= M·k: decode blocks (one per expert run); block_m < M·k: prefill blocks (runs cut into block_m rows).
CASES = [
    (1, 2, 64, 32, 32, 32, False, False, 16),
    (2, 3, 96, 48, 32, 48, True, False, 16),
    (5, 2, 64, 48, 64, 48, False, True, 16),
    (5, 3, 96, 32, 96, 32, True, True, 16),
    (33, 3, 64, 48, 32, 16, True, False, 16),
    (33, 2, 96, 32, 32, 32, False, False, 16),
    (33, 3, 64, 32, 64, 32, False, True, 128),
]
PARAMS = "m,k,h,i,g_up,g_down,asym,act_order,block_m"


@pytest.mark.parametrize(PARAMS, CASES)
def test_reference_equals_float_experts(m, k, h, i, g_up, g_down, asym, act_order, block_m):
    x, ids, weights, w_gate_up, w_down = case(m, 8, k, h, i, g_up, g_down, asym, act_order)
    experts = Experts(SimpleNamespace(num_experts=8, hidden_size=h, moe_intermediate_size=i))
    experts.gate_up_proj.data = dequantize(w_gate_up)
    experts.down_proj.data = dequantize(w_down)
    with torch.no_grad():
        want = experts(x, weights, ids)
    assert rel_err(moe_int4_reference(x, ids, weights, w_gate_up, w_down), want) < 1e-6


triton = pytest.importorskip("triton", reason="triton is not importable: the INT4 MoE kernels are not tested")


@pytest.mark.parametrize(PARAMS + ",in_tile", [c + (False,) for c in CASES] + [CASES[1] + (True,), CASES[6] + (True,)])
def test_triton_equals_reference(m, k, h, i, g_up, g_down, asym, act_order, block_m, in_tile):
    from flashnext.ops.moe_int4_triton import MoeConfig, moe_int4_triton

    x, ids, weights, w_gate_up, w_down = case(m, 8, k, h, i, g_up, g_down, asym, act_order)
    # I = 48: a half-masked N tile
    config = MoeConfig(block_m=block_m, block_n=32, block_k=32, scale_in_tile=in_tile)
    got = moe_int4_triton(x, ids, weights, w_gate_up, w_down, config)
    assert rel_err(got, moe_int4_reference(x, ids, weights, w_gate_up, w_down)) < 1e-5


@pytest.mark.parametrize("m", [2, 33])
def test_triton_fp16_activations(m):
    """The 16-bit path (tensor-core operands, h stored in x's dtype): fp16 runs in the interpreter."""
    from flashnext.ops.moe_int4_triton import MoeConfig, moe_int4_triton

    x, ids, weights, w_gate_up, w_down = case(m, 8, 3, 64, 48, 32, 16, asym=True)
    x, weights = x.half(), weights.half()
    got = moe_int4_triton(x, ids, weights, w_gate_up, w_down, MoeConfig(block_m=16, block_n=32, block_k=32))
    assert got.dtype == torch.float16
    # h and the output are rounded to fp16 (as the 16-bit model rounds them): ~3e-4 here.
    assert rel_err(got, moe_int4_reference(x.float(), ids, weights.float(), w_gate_up, w_down)) < 2e-3


@pytest.mark.parametrize(PARAMS, CASES)
def test_dequant_grouped_gemm_equals_reference(m, k, h, i, g_up, g_down, asym, act_order, block_m):
    """FLASHNEXT_MOE_PREFILL=dequant: a layer's experts dequantised at once (the stacked dequantise kernel,
    interpreted) and the sorted rows through the grouped GEMM; fp32 equals the reference to summation order.
    With 8 experts and few tokens some experts get no rows: their groups are empty."""
    from flashnext.ops.moe_int4_dequant import moe_int4_dequant

    x, ids, weights, w_gate_up, w_down = case(m, 8, k, h, i, g_up, g_down, asym, act_order)
    got = moe_int4_dequant(x, ids, weights, w_gate_up, w_down)
    assert rel_err(got, moe_int4_reference(x, ids, weights, w_gate_up, w_down)) < 1e-5


def test_prefill_path_by_rows_an_expert(monkeypatch):
    """FLASHNEXT_MOE_PREFILL=auto: past the decode kernels (decode_max_m(), FLASHNEXT_MOE_DECODE_MAX_M) the transposed
    tiles below DEQUANT_MIN_ROWS_PER_EXPERT (token, choice) rows an expert on average (512 experts, top-10: 16,384
    tokens), dequantised experts from there; experts the transposed tiles do not take (act-order, groups of 32) the
    grouped kernels below GROUPED_MAX_ROWS_PER_EXPERT (5,120 tokens), then dequantised experts; the decode kernels
    at decode sizes whatever the mode; triton / swapped / dequant force their path past them (swapped where it can)."""
    from flashnext.ops import moe_int4 as ops

    cuda = torch.device("cuda")
    _, _, _, gate_up, down = case(5, 8, 2, 256, 128, 128, 128)          # groups of 128: the transposed tiles suit
    _, _, _, gate_up_ao, down_ao = case(5, 8, 2, 256, 128, 128, 128, act_order=True)
    _, _, _, gate_up_32, down_32 = case(5, 8, 2, 256, 128, 32, 32)

    def path(rows, experts=(gate_up, down)):
        return ops.prefill_path(rows, 10, 512, *experts, cuda)

    monkeypatch.delenv("FLASHNEXT_MOE_PREFILL", raising=False)
    assert path(ops.DECODE_MAX_M) == "decode" and path(ops.DECODE_MAX_M + 1) == "swapped"
    monkeypatch.setenv("FLASHNEXT_MOE_DECODE_MAX_M", "64")
    assert path(64) == "decode" and path(65) == "swapped"
    monkeypatch.delenv("FLASHNEXT_MOE_DECODE_MAX_M")
    assert path(16_383) == "swapped" and path(16_384) == "dequant"
    for unsuited in ((gate_up_ao, down_ao), (gate_up_32, down_32)):
        assert path(ops.DECODE_MAX_M + 1, unsuited) == "grouped" and path(5119, unsuited) == "grouped"
        assert path(5120, unsuited) == "dequant" and path(8000, unsuited) == "dequant"
    monkeypatch.setenv("FLASHNEXT_MOE_PREFILL", "triton")
    assert path(100_000) == "grouped" and path(ops.DECODE_MAX_M) == "decode"
    monkeypatch.setenv("FLASHNEXT_MOE_PREFILL", "dequant")
    assert path(ops.DECODE_MAX_M + 1) == "dequant" and path(ops.DECODE_MAX_M) == "decode"
    monkeypatch.setenv("FLASHNEXT_MOE_PREFILL", "swapped")
    assert path(ops.DECODE_MAX_M + 1) == "swapped" and path(100_000) == "swapped"
    assert path(100_000, (gate_up_ao, down_ao)) == "grouped"


def test_dequant_scratch_is_the_larger_dequantised_stack():
    from flashnext.ops.moe_int4_dequant import dequant_scratch_bytes

    w_gate_up, w_down = random_int4(6, 2 * 48, 64, 32), random_int4(6, 64, 48, 16)
    assert dequant_scratch_bytes(w_gate_up, w_down, torch.bfloat16) == 6 * 2 * 48 * 64 * 2


def test_dequant_grouped_gemm_fp16():
    """16-bit activations: each weight, the GEMMs' outputs and h rounded to fp16."""
    from flashnext.ops.moe_int4_dequant import moe_int4_dequant

    x, ids, weights, w_gate_up, w_down = case(40, 8, 3, 64, 48, 32, 16, asym=True)
    want = moe_int4_reference(x, ids, weights, w_gate_up, w_down)
    got = moe_int4_dequant(x.half(), ids, weights.half(), w_gate_up, w_down)
    assert got.dtype == torch.float16 and rel_err(got, want) < 2e-3


@pytest.mark.parametrize("m", [3, 40, 150])
def test_triton_default_configs(m):
    """No config given: SMALL's tiles up to SMALL_MAX_M tokens (blocks at each expert's first row while no run can
    pass its block_m: 3 tokens), PREFILL's grouped tiles (scale in the tile) above."""
    from flashnext.ops.moe_int4_triton import PREFILL, SMALL, SMALL_MAX_M, default_config, moe_int4_triton

    assert 3 * 3 < SMALL.block_m < 40 * 3 and 40 < SMALL_MAX_M < 150
    assert default_config(m) == {3: SMALL, 40: SMALL, 150: PREFILL}[m]
    assert (default_config(SMALL_MAX_M), default_config(SMALL_MAX_M + 1)) == (SMALL, PREFILL)
    x, ids, weights, w_gate_up, w_down = case(m, 8, 3, 128, 64, 64, 64, asym=True)
    got = moe_int4_triton(x, ids, weights, w_gate_up, w_down)
    assert rel_err(got, moe_int4_reference(x, ids, weights, w_gate_up, w_down)) < 1e-5


@pytest.mark.parametrize("m", [3, 40])
def test_terms_in_rounds_sum_to_one_call(m):
    """An expert cache runs the grouped kernels a round of experts at a time, the other choices pointed at a
    resident stand-in (so a token may choose it twice, and one expert's run of rows may pass BLOCK_M), keeps each
    round's own terms and sums once: one call's result. Bit for bit on the GPU (scripts/gpu_expert_cache.py); here
    to rounding, as the interpreter's numpy dot rounds a row by its place in the tile."""
    from flashnext.ops.moe_int4_triton import moe_int4_triton, moe_int4_triton_pairs

    x, ids, weights, w_gate_up, w_down = case(m, 8, 3, 128, 64, 64, 64, asym=True)
    terms = None
    for chunk in ([0, 1, 2], [3, 4, 5], [6, 7]):
        mask = torch.isin(ids, torch.tensor(chunk))
        part = moe_int4_triton_pairs(x, torch.where(mask, ids, chunk[0]), weights, w_gate_up, w_down)
        terms = part if terms is None else torch.where(mask[..., None], part, terms)
    want = moe_int4_triton(x, ids, weights, w_gate_up, w_down)
    assert rel_err(terms.sum(1).to(x.dtype), want) < 1e-6
    assert rel_err(terms.sum(1), moe_int4_reference(x, ids, weights, w_gate_up, w_down)) < 1e-5
    assert rel_err(part.sum(1), want) > 1e-2       # the last round alone is not it: the merge of the rounds matters
