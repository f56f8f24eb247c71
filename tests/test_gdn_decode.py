"""GatedDeltaNet decode step: the reference against GatedDeltaNet.forward on one-token segments (both projection
layouts, both gate activations), and the Triton kernels (CPU: TRITON_INTERPRET=1) against the reference at odd
sizes, with strided inputs, untouched slots and several consecutive steps."""
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from oracle import TINY, randomise

from flashnext.cache.state_pool import StatePool
from flashnext.models.context import ForwardContext, Segment
from flashnext.models.layers.gated_delta_net import GatedDeltaNet
from flashnext.ops.gdn_decode import gdn_decode, gdn_decode_reference
from flashnext.weights.config import parse_config


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def make_layer(arch: str, activation: str, dtype=torch.float32, seed=0, **overrides):
    cfg = parse_config({**TINY[arch], **overrides})
    torch.manual_seed(seed)
    layer = GatedDeltaNet(cfg, cfg.linear_layers()[0])
    randomise(layer)
    layer.norm.activation = activation
    layer.out_proj = torch.nn.Identity()   # the op stops before out_proj
    return layer.to(dtype).eval(), cfg


def random_pool(cfg, layer_idx, num_slots, dtype, seed):
    pool = StatePool(cfg, num_slots, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    pool.conv[layer_idx].copy_(torch.randn(pool.conv[layer_idx].shape, generator=gen))
    # A state of a few dozen tokens' worth of updates: entries of order 0.1-1.
    pool.ssm[layer_idx].copy_(torch.randn(pool.ssm[layer_idx].shape, generator=gen) * 0.3)
    return pool


def layer_kwargs(layer):
    return {"num_k_heads": layer.num_k_heads, "head_k_dim": layer.head_k_dim, "num_v_heads": layer.num_v_heads,
            "head_v_dim": layer.head_v_dim, "eps": layer.norm.eps, "activation": layer.norm.activation}


# --- the reference is the layer ------------------------------------------------------------------------

LAYER_CASES = [  # (arch, activation, overrides): split = qwen4_exp / qwen3_5_moe, fused = qwen3_next
    ("qwen4_exp", "sigmoid", {}),
    ("qwen4_exp", "silu", {"linear_key_head_dim": 12, "linear_value_head_dim": 20}),
    ("qwen3_5_moe", "silu", {}),
    ("qwen3_next", "silu", {"linear_num_value_heads": 6, "linear_value_head_dim": 20}),
    ("qwen3_next", "sigmoid", {}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,activation,overrides", LAYER_CASES)
@torch.no_grad()
def test_reference_equals_layer_forward(arch, activation, overrides, dtype):
    layer, cfg = make_layer(arch, activation, dtype, **overrides)
    li = layer.layer_idx
    slots = [4, 0, 6, 2]
    pool = random_pool(cfg, li, 7, dtype, seed=1)
    conv, ssm = pool.conv[li].clone(), pool.ssm[li].clone()
    x = torch.randn(len(slots), cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    segments = [Segment(slot=s, blocks=torch.zeros(1, dtype=torch.long), start=i, length=1, context_len=5)
                for i, s in enumerate(slots)]
    want = layer(x, ForwardContext(segments, SimpleNamespace(device=torch.device("cpu")), pool))

    mixed, z, b, a = layer._project(x)
    got = gdn_decode_reference(mixed, z, b, a, conv, layer.conv1d.weight.squeeze(1), ssm, torch.tensor(slots),
                               layer.A_log, layer.dt_bias, layer.norm.weight, **layer_kwargs(layer))
    assert got.dtype == dtype and got.shape == want.shape
    # Bitwise equal today; the bound allows for fp32 summation order (the layer reduces over Dk in another
    # memory layout), which in bf16 can flip the last bit of a rounded o.
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    assert rel_err(got, want) < tol
    assert torch.equal(conv, pool.conv[li])
    assert rel_err(ssm, pool.ssm[li]) < 1e-5


# --- the Triton kernels against the reference ----------------------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not importable (pip install triton)")


@pytest.fixture(scope="module")
def kernels():
    from flashnext.ops import gdn_decode_triton
    return gdn_decode_triton


def make_problem(hk, hv, dk, dv, width, rows, num_slots, dtype, seed, strided=False):
    """Random inputs of one decode step and states at random slots; `strided` gives z, b and a the layouts
    of qwen3_next's fused projections (views into wider rows)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    channels = 2 * hk * dk + hv * dv
    if strided:
        z = rand(rows, hv, 2 * dv)[..., dv:]
        ba = rand(rows, 2 * hv)
        b, a = ba[:, :hv], ba[:, hv:]
    else:
        z, b, a = rand(rows, hv, dv), rand(rows, hv), rand(rows, hv)
    inputs = {
        "mixed_qkv": rand(rows, channels), "z": z, "b": b, "a": a,
        "conv_state": rand(num_slots, width - 1, channels), "conv_weight": rand(channels, width, scale=width ** -0.5),
        "ssm_state": rand(num_slots, hv, dk, dv, scale=0.3),
        "slots": torch.randperm(num_slots, generator=gen)[:rows].to(device),
        "A_log": rand(hv, scale=0.5), "dt_bias": rand(hv, scale=0.5), "norm_weight": 1 + rand(dv, scale=0.2)}
    for name in ("mixed_qkv", "z", "b", "a", "conv_state", "conv_weight", "norm_weight"):
        inputs[name] = inputs[name].to(dtype)
    return inputs, {"num_k_heads": hk, "head_k_dim": dk, "num_v_heads": hv, "head_v_dim": dv, "eps": 1e-6}


def run_both(kernels, inputs, kw, activation):
    """(triton out, reference out), each on its own copy of the states, which are returned in place."""
    ref_states = {n: inputs[n].clone() for n in ("conv_state", "ssm_state")}
    want = gdn_decode_reference(**{**inputs, **ref_states}, **kw, activation=activation)
    got = kernels.gdn_decode_triton(**inputs, **kw, activation=activation)
    return got, want, ref_states


KERNEL_CASES = [  # (Hk, Hv, Dk, Dv, K, B, S, strided)
    (2, 6, 16, 32, 4, 3, 5, False),
    (1, 3, 12, 20, 4, 4, 6, True),     # non-power-of-two heads: masked lanes
    (2, 2, 32, 16, 3, 1, 2, False),    # one value head per key head, conv width 3
    (2, 4, 16, 16, 4, 5, 5, True),     # every slot in the batch
    (2, 4, 16, 32, 2, 3, 5, False),    # conv width 2: a one-row tail
]


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("hk,hv,dk,dv,width,rows,num_slots,strided", KERNEL_CASES)
def test_triton_matches_reference(kernels, hk, hv, dk, dv, width, rows, num_slots, strided, activation):
    inputs, kw = make_problem(hk, hv, dk, dv, width, rows, num_slots, torch.float32, seed=rows + dv, strided=strided)
    before = {n: inputs[n].clone() for n in ("conv_state", "ssm_state")}
    got, want, ref_states = run_both(kernels, inputs, kw, activation)
    assert got.shape == (rows, hv * dv) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5
    assert rel_err(inputs["conv_state"], ref_states["conv_state"]) < 1e-6
    assert rel_err(inputs["ssm_state"], ref_states["ssm_state"]) < 1e-5
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[inputs["slots"].cpu()] = False
    for name in ("conv_state", "ssm_state"):
        assert torch.equal(inputs[name][untouched], before[name][untouched])


@needs_triton
def test_triton_consecutive_steps(kernels):
    inputs, kw = make_problem(2, 6, 16, 32, 4, 3, 5, torch.float32, seed=11)
    ref_states = {n: inputs[n].clone() for n in ("conv_state", "ssm_state")}
    gen = torch.Generator().manual_seed(12)
    for step in range(4):
        if step:  # new token projections; the batch's rows are reordered, as the scheduler may do
            for name in ("mixed_qkv", "z", "b", "a"):
                inputs[name] = torch.randn(inputs[name].shape, generator=gen).to(inputs[name].device)
            inputs["slots"] = inputs["slots"][torch.randperm(3, generator=gen).to(inputs["slots"].device)]
        want = gdn_decode_reference(**{**inputs, **ref_states}, **kw, activation="silu")
        got = kernels.gdn_decode_triton(**inputs, **kw, activation="silu")
        assert rel_err(got, want) < 1e-5, step
    assert rel_err(inputs["ssm_state"], ref_states["ssm_state"]) < 1e-5
    assert rel_err(inputs["conv_state"], ref_states["conv_state"]) < 1e-6


@needs_triton
@pytest.mark.parametrize("norm_dtype", [torch.float16, torch.float32])
def test_triton_half_precision(kernels, norm_dtype):
    # fp16 exercises the rounding points (conv output, β, o, the weighted norm when the weight is fp16). bf16 is
    # only checked on the GPU (scripts/gpu_gdn_decode.py): Triton's interpreter gets bf16 casts wrong.
    inputs, kw = make_problem(2, 6, 16, 32, 4, 3, 5, torch.float16, seed=5, strided=True)
    inputs["norm_weight"] = inputs["norm_weight"].to(norm_dtype)
    got, want, ref_states = run_both(kernels, inputs, kw, "silu")
    assert got.dtype == torch.float16 and rel_err(got, want) < 5e-3
    assert torch.equal(inputs["conv_state"], ref_states["conv_state"])
    assert rel_err(inputs["ssm_state"], ref_states["ssm_state"]) < 1e-3


@needs_triton
def test_dispatch_and_empty_batch(kernels, monkeypatch):
    inputs, kw = make_problem(2, 4, 16, 16, 4, 2, 3, torch.float32, seed=3)
    monkeypatch.setenv("FLASHNEXT_GDN_DECODE", "reference")
    ref_states = {n: inputs[n].clone() for n in ("conv_state", "ssm_state")}
    assert torch.equal(gdn_decode(**{**inputs, **ref_states}, **kw, activation="silu"),
                       gdn_decode_reference(**inputs, **kw, activation="silu"))
    empty = {**inputs, "mixed_qkv": inputs["mixed_qkv"][:0], "z": inputs["z"][:0], "b": inputs["b"][:0],
             "a": inputs["a"][:0], "slots": inputs["slots"][:0]}
    assert kernels.gdn_decode_triton(**empty, **kw, activation="silu").shape == (0, 4 * 16)
