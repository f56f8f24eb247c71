"""The delta rule's two forms meet at CHUNKED_MIN: gated_delta_rule runs shorter inputs token by token and longer ones
chunked, and GatedDeltaNet.decode runs a chained batch (one sequence's consecutive tokens) shorter than it row by row
through the decode kernels, longer as a prefill segment. On both sides of the threshold (CHUNKED_MIN − 1 and
CHUNKED_MIN rows, from a non-zero state, odd head sizes, fp32) the output and the new state equal the reference's:
transformers' token-by-token delta rule for the op, the same tokens fed one a step for the layer."""
from types import SimpleNamespace

import pytest
import torch

from flashnext.cache.state_pool import StatePool
from flashnext.models.context import ForwardContext, Segment
from flashnext.models.decode_batch import DecodeBatch
from flashnext.models.layers import gated_delta_net
from flashnext.models.layers.gated_delta_net import GatedDeltaNet
from flashnext.ops import gated_delta_rule as rule
from flashnext.ops.gated_delta_rule import CHUNKED_MIN, gated_delta_rule
from flashnext.weights.config import parse_config
from oracle import TINY, randomise, rel_err

SIDES = [CHUNKED_MIN - 1, CHUNKED_MIN]
TOL = 1e-5


def forms_run(monkeypatch) -> list[str]:
    """Records which form of the delta rule each call of gated_delta_rule takes."""
    ran = []
    for form in ("recurrent", "chunked"):
        fn = getattr(rule, f"gated_delta_rule_{form}")
        monkeypatch.setattr(rule, f"gated_delta_rule_{form}",
                            lambda *args, fn=fn, form=form, **kw: (ran.append(form), fn(*args, **kw))[1])
    return ran


@pytest.mark.parametrize("length", SIDES)
def test_gated_delta_rule_on_both_sides_of_chunked_min(length, monkeypatch):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    hk, hv, dk, dv = 2, 6, 12, 20
    g = torch.Generator().manual_seed(length)
    q, k = (torch.randn(length, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(length, hv, dv, generator=g)
    decay = -torch.rand(length, hv, generator=g) * 2             # log decay, as -exp(A_log)·softplus(a + dt_bias)
    beta = torch.rand(length, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g) * 0.3
    ran = forms_run(monkeypatch)
    o, new_state = gated_delta_rule(q, k, v, decay, beta, state)
    assert ran == ["recurrent" if length < CHUNKED_MIN else "chunked"]
    want_o, want_state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                                          initial_state=state[None], output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    assert rel_err(o, want_o[0]) < TOL and rel_err(new_state, want_state[0]) < TOL


@pytest.mark.parametrize("length", SIDES)
@torch.no_grad()
def test_gated_delta_net_on_both_sides_of_chunked_min(length, monkeypatch):
    cfg = parse_config({**TINY["qwen3_next"], "linear_num_value_heads": 6, "linear_value_head_dim": 20})
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, cfg.linear_layers()[0]).eval()
    randomise(layer)
    li, slot = layer.layer_idx, 1
    g = torch.Generator().manual_seed(length)
    x = torch.randn(length, cfg.hidden_size, generator=g)
    start = StatePool(cfg, 3, torch.float32, "cpu")
    start.conv[li].copy_(torch.randn(start.conv[li].shape, generator=g))
    start.ssm[li].copy_(torch.randn(start.ssm[li].shape, generator=g) * 0.3)
    cpu = SimpleNamespace(device=torch.device("cpu"))

    def pool():
        states = StatePool(cfg, 3, torch.float32, "cpu")
        states.conv[li].copy_(start.conv[li])
        states.ssm[li].copy_(start.ssm[li])
        return states

    def segment(states, rows, context_len):
        return ForwardContext([Segment(slot, torch.zeros(1, dtype=torch.long), 0, rows, context_len)], cpu, states)

    # the reference: the tokens one a step (each a one-token segment: the recurrent form)
    ref = pool()
    want = torch.cat([layer(x[i:i + 1], segment(ref, 1, 5 + i)) for i in range(length)])

    ran = forms_run(monkeypatch)
    whole = pool()
    got = layer(x, segment(whole, length, 5))                     # one prefill segment
    assert ran == ["recurrent" if length < CHUNKED_MIN else "chunked"]

    ran.clear()
    rows, decode_rows = [], gated_delta_net.gdn_decode      # rows of each call of the decode kernels
    monkeypatch.setattr(gated_delta_net, "gdn_decode",
                        lambda *args, **kw: (rows.append(len(args[0])), decode_rows(*args, **kw))[1])
    chained = pool()
    batch = DecodeBatch.from_lists(list(range(length)), list(range(5, 5 + length)), [slot] * length, [[0]] * length,
                                   cpu, chained)
    batch.chained = True
    decoded = layer.decode(x, batch)                              # a chained batch
    assert (rows, ran) == (([1] * length, []) if length < CHUNKED_MIN else ([], ["chunked"]))

    for out, states in ((got, whole), (decoded, chained)):
        assert rel_err(out, want) < TOL
        assert rel_err(states.conv[li][slot], ref.conv[li][slot]) < TOL
        assert rel_err(states.ssm[li][slot], ref.ssm[li][slot]) < TOL
