"""Hyper-connection mix/inject ops: the reference against HyperConnection (bit for bit, fp32 and bf16), and the
Triton kernels (CPU: TRITON_INTERPRET=1, fp32 only — the interpreter gets bf16 wrong) against the reference at
odd sizes, with the K splits, row tiles and row blocks that the decode shapes use."""
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from flashnext.models.layers.hyper_connection import HyperConnection
from flashnext.ops.hyper_connection import hc_inject, hc_inject_reference, hc_mix, hc_mix_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def make_layer(hc, hidden, lowrank, with_injection, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = SimpleNamespace(hc_count=hc, hidden_size=hidden, hc_hidden_size=hc * hidden, hc_lowrank=lowrank,
                          rms_norm_eps=1e-6)
    layer = HyperConnection(cfg, with_injection=with_injection)
    with torch.no_grad():  # default init zeroes the norm weight, which would hide a missing (1 + w)
        layer.hc_norm.weight.normal_(0, 0.2)
    return layer.to(dtype)


def mix_args(layer):
    inject = layer.block_inject_weight.weight if layer.block_inject_weight is not None else None
    return (layer.hc_norm.weight, layer.input_mix_weight_down.weight, layer.input_mix_weight_up.weight, inject,
            layer.hc, layer.hidden, layer.hc_norm.eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hc,with_injection", [(2, True), (4, True), (4, False)])
def test_reference_equals_module(hc, with_injection, dtype):
    """Against transformers' own hyper-connection (the oracle): our HyperConnection.mix now calls this op."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual
    from oracle import hf_config

    layer = make_layer(hc, 64, 16, with_injection, dtype)
    config, _ = hf_config("qwen4_exp", hidden_size=64, hc_count=hc, hc_lowrank=16)
    oracle = Qwen4ExpTextGatedResidual(config, use_combine=with_injection).to(dtype)
    oracle.load_state_dict(layer.state_dict())
    h = (torch.randn(5, hc * 64) * 3).to(dtype)
    with torch.no_grad():
        want = oracle(h)
        want_input, want_weights = (want[0], want[2]) if with_injection else (want, None)
        got_input, got_weights = hc_mix_reference(h, *mix_args(layer))
    assert got_input.dtype == dtype and torch.equal(got_input, want_input)
    if with_injection:
        assert got_weights.dtype == dtype and torch.equal(got_weights, want_weights)
    else:
        assert got_weights is None and want_weights is None
    block_output = torch.randn(5, 64).to(dtype)
    weights = (torch.rand(5, hc) * 2).to(dtype)
    stream_by_stream = torch.cat([h[:, i * 64:(i + 1) * 64] + weights[:, i:i + 1] * block_output for i in range(hc)], dim=1)
    assert torch.equal(hc_inject_reference(h, block_output, weights), stream_by_stream)


def test_dispatch_off_cuda_is_the_reference():
    layer = make_layer(2, 64, 16, True)
    h = torch.randn(3, 128)
    with torch.no_grad():
        got, want = hc_mix(h, *mix_args(layer)), hc_mix_reference(h, *mix_args(layer))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out = torch.empty_like(h)
    assert hc_inject(h, h[:, :64], got[1], out=out) is out
    assert torch.equal(out, hc_inject_reference(h, h[:, :64], got[1]))


# --- Triton kernels (interpreted on CPU) ---------------------------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not importable (pip install triton)")


@pytest.fixture(scope="module")
def kernels():
    from flashnext.ops import hyper_connection_triton
    return hyper_connection_triton


@needs_triton
@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("hc,with_injection", [(2, True), (4, True), (4, False)])
def test_triton_mix_matches_reference(kernels, n, hc, with_injection):
    layer = make_layer(hc, 64, 16, with_injection, seed=n).to(DEVICE)
    h = torch.randn(n, hc * 64, device=DEVICE) * 3
    with torch.no_grad():
        want_input, want_weights = hc_mix_reference(h, *mix_args(layer))
        got_input, got_weights = kernels.hc_mix_triton(h, *mix_args(layer))
    assert got_input.shape == (n, 64) and rel_err(got_input, want_input) < 1e-5
    if with_injection:
        assert got_weights.shape == (n, hc) and rel_err(got_weights, want_weights) < 1e-5
    else:
        assert got_weights is None


@needs_triton
@pytest.mark.parametrize("n,hc,with_injection", [(5, 4, True), (3, 3, False)])
def test_triton_mix_ragged_tiles(kernels, n, hc, with_injection):
    # hidden 60, lowrank 20: every tile is ragged (60 of 64 lanes, 20 of 32), hc 3 pads the streams to 4, the
    # third row tile of 8 straddles the down/inject boundary (rows 16–23); repeated launches give the same values.
    layer = make_layer(hc, 60, 20, with_injection, seed=7).to(DEVICE)
    h = torch.randn(n, 2 * hc * 60, device=DEVICE)[:, ::2]  # a strided h is accepted
    cfg = kernels.MixConfig(block_r=8, block_h=16)
    with torch.no_grad():
        want_input, want_weights = hc_mix_reference(h, *mix_args(layer))
        got_input, got_weights = kernels.hc_mix_triton(h, *mix_args(layer), config=cfg)
        assert rel_err(got_input, want_input) < 1e-5
        assert (got_weights is None) if not with_injection else rel_err(got_weights, want_weights) < 1e-5
        again_input, again_weights = kernels.hc_mix_triton(h, *mix_args(layer), config=cfg)
        assert torch.equal(again_input, got_input) and (again_weights is None or torch.equal(again_weights, got_weights))
    assert kernels.hc_mix_triton(h[:0], *mix_args(layer))[0].shape == (0, 60)


@needs_triton
@pytest.mark.parametrize("n,hc,with_injection", [(1, 4, True), (3, 3, True), (2, 4, False)])
def test_triton_mix_after_a_pending_injection(kernels, n, hc, with_injection):
    """The mix's down kernel does the previous block's injection on its way in: the block input and weights equal
    the reference's mix of the injected streams, and the injected streams it writes equal hc_inject's, bit for bit
    (the same rounding), at ragged sizes (hidden 60, lowrank 20) and with strided inputs."""
    layer = make_layer(hc, 60, 20, with_injection, seed=11).to(DEVICE)
    h = torch.randn(n, 2 * hc * 60, device=DEVICE)[:, ::2]
    block_output = torch.randn(n, 2 * 60, device=DEVICE)[:, ::2]
    weights = torch.rand(n, hc, device=DEVICE) * 2
    before = h.clone()
    with torch.no_grad():
        want_h = hc_inject_reference(h, block_output, weights)
        want_input, want_weights = hc_mix_reference(want_h, *mix_args(layer))
        cfg = kernels.MixConfig(block_r=8, block_h=16)
        got_input, got_weights, got_h = kernels.hc_mix_injected_triton(h, block_output, weights, *mix_args(layer),
                                                                       config=cfg)
    assert torch.equal(got_h, kernels.hc_inject_triton(h.contiguous(), block_output.contiguous(), weights))
    assert rel_err(got_h, want_h) < 1e-6
    assert rel_err(got_input, want_input) < 1e-5
    assert (got_weights is None) if not with_injection else rel_err(got_weights, want_weights) < 1e-5
    assert torch.equal(h, before)   # the input streams are left as they were (a new h comes out)


def test_pending_injection_falls_back_to_inject_then_mix():
    """Off the Triton path (CPU, FLASHNEXT_HC=reference, or FLASHNEXT_HC_FUSED_INJECT=0) hc_mix_injected is
    hc_inject then hc_mix."""
    from flashnext.ops.hyper_connection import PendingInjection, hc_mix_injected

    layer = make_layer(4, 64, 16, True, seed=3)
    h, block_output, weights = torch.randn(2, 256), torch.randn(2, 64), torch.rand(2, 4) * 2
    got = hc_mix_injected(PendingInjection(h, block_output, weights), *mix_args(layer))
    injected = hc_inject_reference(h, block_output, weights)
    want = hc_mix_reference(injected, *mix_args(layer))
    assert torch.equal(got[2], injected) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_triton
@pytest.mark.parametrize("n,hc", [(1, 4), (3, 2), (5, 4)])
def test_triton_inject_matches_reference(kernels, n, hc):
    h = torch.randn(n, hc * 600, device=DEVICE)
    block_output = torch.randn(n, 600, device=DEVICE)
    weights = torch.rand(n, hc, device=DEVICE) * 2
    want = hc_inject_reference(h, block_output, weights)
    assert rel_err(kernels.hc_inject_triton(h, block_output, weights), want) < 1e-6
    kernels.hc_inject_triton(h, block_output, weights, out=h)
    assert rel_err(h, want) < 1e-6


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("rows,hc,hidden", [(37, 4, 48), (3, 2, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_kernel_equals_reference(rows, hc, hidden, dtype):
    """The prefill mix's last step (sigmoid × normed, mean over streams) in one kernel, rounding where the
    reference rounds."""
    from flashnext.ops.hyper_connection import hc_combine_reference
    from flashnext.ops.hyper_connection_triton import hc_combine_triton

    g = torch.Generator().manual_seed(rows + hidden)
    up = (torch.randn(rows, hc * hidden, generator=g) * 3).to(dtype)
    normed = torch.randn(rows, hc * hidden, generator=g).to(dtype)
    got = hc_combine_triton(up, normed, hc, hidden)
    want = hc_combine_reference(up, normed, hc, hidden)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: off the GPU hc_mix always takes the reference")
def test_decode_rows_take_the_kernels_their_count_calls_for(monkeypatch):
    """One row: the one-row mix kernels; from FLASHNEXT_HC_ROWS_MIN rows the tensor-core ones; above
    FLASHNEXT_HC_DECODE_MAX_ROWS the reference math with cuBLAS and the norm and combine kernels (a prefill's)."""
    from flashnext.ops.hyper_connection import hc_combine
    from flashnext.ops.hyper_connection_rows_triton import hc_mix_rows_triton
    from flashnext.ops.hyper_connection_triton import hc_mix_triton
    from flashnext.ops.rms_norm import rms_norm

    monkeypatch.setenv("FLASHNEXT_HC_DECODE_MAX_ROWS", "2")
    monkeypatch.setenv("FLASHNEXT_HC_ROWS_MIN", "2")
    layer = make_layer(4, 640, 80, True, torch.bfloat16, seed=4).to("cuda")
    for n in (1, 2, 3):
        h = (torch.randn(n, 4 * 640, device="cuda") * 2).bfloat16()
        got = hc_mix(h, *mix_args(layer))
        want = (hc_mix_triton(h, *mix_args(layer)) if n == 1 else
                hc_mix_rows_triton(h, None, *mix_args(layer))[:2] if n == 2 else
                hc_mix_reference(h, *mix_args(layer), norm=rms_norm, combine=hc_combine))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_triton
@pytest.mark.parametrize("n,hc,with_injection,pending,block_k,block_r", [
    (2, 4, True, False, 128, 16), (5, 3, True, True, 128, 16), (16, 4, False, True, 128, 16), (7, 2, True, True, 512, 32),
    (3, 4, True, True, 256, 16), (37, 3, True, True, 128, 16), (17, 4, False, False, 256, 32)])
def test_rows_kernels_match_the_reference(n, hc, with_injection, pending, block_k, block_r):
    """The tensor-core mix (ops/hyper_connection_rows_triton.py), fp32 (IEEE dots) at ragged sizes — 17 and 37 rows
    are two and three tiles of 16 rows of h, the last ragged: hidden 300 is
    three K splits of 128 (the last ragged), two of 256 (the default) or one of 512; lowrank 20 puts the down/inject
    boundary inside the second row tile of 16, or all rows in one tile of 32. hc 3 pads the up kernel's streams to 4.
    After a pending injection the injected streams it writes equal hc_inject's bit for bit (without one, h comes back);
    a second launch gives the same bits (the fixed-order sums: meaningful on a GPU, where the programs race — the
    interpreter runs them in order); the arrival counters are left zeroed."""
    from flashnext.ops import arrival
    from flashnext.ops.hyper_connection_rows_triton import RowsConfig, hc_mix_rows_triton
    from flashnext.ops.hyper_connection_triton import hc_inject_triton

    config = RowsConfig(block_r=block_r, block_k=block_k)

    layer = make_layer(hc, 300, 20, with_injection, seed=n).to(DEVICE)
    h = torch.randn(n, 2 * hc * 300, device=DEVICE)[:, ::2] * 3   # a strided h is accepted
    block_output, weights = torch.randn(n, 300, device=DEVICE), torch.rand(n, hc, device=DEVICE) * 2
    before = h.clone()
    with torch.no_grad():
        mixed = hc_inject_reference(h, block_output, weights) if pending else h
        want_input, want_weights = hc_mix_reference(mixed, *mix_args(layer))
        inputs = (block_output, weights) if pending else None
        got_input, got_weights, got_h = hc_mix_rows_triton(h, inputs, *mix_args(layer), config=config)
        again = hc_mix_rows_triton(h, inputs, *mix_args(layer), config=config)
    assert got_input.shape == (n, 300) and rel_err(got_input, want_input) < 1e-5
    assert (got_weights is None) if not with_injection else rel_err(got_weights, want_weights) < 1e-5
    if pending:
        assert torch.equal(got_h, hc_inject_triton(h.contiguous(), block_output, weights))
    else:
        assert torch.equal(got_h, h)
    assert torch.equal(again[0], got_input) and (got_weights is None or torch.equal(again[1], got_weights))
    assert torch.equal(h, before)
    assert all(int(b.abs().sum()) == 0 for b in arrival.buffers(torch.device(DEVICE)))
    assert hc_mix_rows_triton(h[:0], None, *mix_args(layer))[0].shape == (0, 300)
