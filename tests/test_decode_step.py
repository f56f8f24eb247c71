"""The fixed-shape decode step (`model.decode(DecodeBatch)`, what a CUDA graph captures) equals the eager
forward of one-token segments, for every architecture, over a batch of sequences of different lengths that
crosses the QSA selection threshold, with padded block tables and a padding row on a scratch slot."""
import pytest
import torch

from flashnext.cache.kv_pool import KVPool
from flashnext.cache.state_pool import StatePool
from flashnext.models.context import ForwardContext, Segment
from flashnext.models.decode_batch import DecodeBatch
from oracle import hf_model, ours_from_hf, rel_err
from test_model_parity import CASES, IDS

TOL = 1e-5
PROMPTS = (5, 23, 40)      # the tiny QSA budget is 8–12 tokens: rows start below and above it
SLOTS = (4, 1, 2)          # not in order on purpose
STEPS = 20


def _pools(cfg):
    block_size = KVPool.fit_block_size(cfg, 8)
    kv = KVPool(cfg, 40, block_size, torch.float32, "cpu")
    states = StatePool(cfg, 6, torch.float32, "cpu")
    for slot in range(6):
        states.allocate()
    return kv, states


def _prefill(model, kv, states, prompts, tables):
    segments, start = [], 0
    for p, slot, blocks in zip(prompts, SLOTS, tables):
        segments.append(Segment(slot, torch.tensor(blocks), start, len(p), 0))
        start += len(p)
    hidden = model(torch.cat(prompts), ForwardContext(segments, kv, states))
    return model.compute_logits(hidden[torch.tensor([s.end - 1 for s in segments])])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_decode_equals_eager_segments(case):
    _check_decode(case, PROMPTS, STEPS, extra_width=3)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "qwen4_exp"], ids=[i for i in IDS if "qwen4" in i])
def test_short_table_decodes_dense_without_scoring(case):
    """A block table narrower than the indexer's top-k takes the dense branch; it must equal the scored path."""
    _check_decode(case, (2, 3, 1), 2, extra_width=0)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=[IDS[0], IDS[2]])
def test_int4_decode_runs_the_shared_expert_in_the_expert_kernels(case):
    """INT4 experts and dense projections (`--quantize int4`, stacked as loading does): the decode step hands the
    shared expert to the routed kernels as one more expert (Int4Experts.shared_int4) and still equals the
    eager forward, which runs it on its own."""
    from flashnext.models.layers.moe import SparseMoe
    from flashnext.models.quantize import quantize_dense_int4, quantize_experts_int4
    from flashnext.models.stacked import stack_projections

    def int4(model):
        quantize_dense_int4(model)
        quantize_experts_int4(model)
        stack_projections(model)
        moes = [m for m in model.modules() if isinstance(m, SparseMoe)]
        assert moes and all(m.experts.shared_int4(m.shared_expert, torch.zeros(1, 1)) is not None for m in moes)
        return model

    _check_decode(case, PROMPTS, 6, extra_width=1, transform=int4)


def _check_decode(case, prompts_len, steps, extra_width, transform=lambda model: model):
    arch, overrides = case
    hf, raw = hf_model(arch, seed=CASES.index(case), **overrides)
    model = transform(ours_from_hf(hf, raw))
    cfg = model.cfg
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in prompts_len]
    eager, fixed = _pools(cfg), _pools(cfg)
    need = [eager[0].blocks_for(n + steps) for n in prompts_len]
    tables = [eager[0].allocate(n) for n in need]
    assert [fixed[0].allocate(n) for n in need] == tables
    scratch_block = fixed[0].allocate(1)[0]
    width = max(need) + extra_width                        # padded wider than any row needs
    with torch.inference_mode():
        logits = _prefill(model, *eager, prompts, tables)
        assert torch.equal(_prefill(model, *fixed, prompts, tables), logits)
        lengths = list(prompts_len)
        for _ in range(steps):
            tokens = logits.argmax(-1)
            segments = [Segment(slot, torch.tensor(t), i, 1, n) for i, (slot, t, n) in enumerate(zip(SLOTS, tables, lengths))]
            logits = model.compute_logits(model(tokens, ForwardContext(segments, *eager)))
            # A fourth row pads the batch the way the graph runner does: scratch slot 0, scratch block, position 0.
            batch = DecodeBatch.from_lists(tokens.tolist() + [0], lengths + [0], list(SLOTS) + [0],
                                           tables + [[scratch_block]], *fixed, width=width)
            got = model.compute_logits(model.decode(batch))[:3]
            assert rel_err(got, logits) < TOL
            lengths = [n + 1 for n in lengths]
    if cfg.arch == "qwen4_exp" and extra_width:
        assert min(prompts_len) < cfg.indexer_budget < max(prompts_len), "rows must start on both sides of the budget"
    # The states of the real rows moved on identically; the KV rows they wrote are the same.
    for name, t in eager[1].tensors().items():
        for slot in SLOTS:
            assert rel_err(fixed[1].tensors()[name][slot].float(), t[slot].float()) < TOL, name
    for layer in cfg.attention_layers():
        rows = torch.cat([eager[0].token_rows(torch.tensor(t), 0, n) for t, n in zip(tables, lengths)])
        assert rel_err(fixed[0].k[layer].view(-1, *fixed[0].k[layer].shape[2:])[rows],
                       eager[0].k[layer].view(-1, *eager[0].k[layer].shape[2:])[rows]) < TOL
