"""Parallel decode branches (ops/branches.py): on CPU, or switched off, the parts run in order and return in
order; split-K kernels of different lanes count on different arrival buffers, so branches cannot share one."""
import torch

from flashnext.ops import branches


def test_parts_run_in_order_where_there_are_no_streams(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_DECODE_BRANCHES", "1")
    x = torch.zeros(1, 4)
    assert not branches.enabled(x)          # CPU: no side streams
    order = []
    assert branches.parallel(x, lambda: order.append("a") or 1, lambda: order.append("b") or (2, 3)) == (1, (2, 3))
    assert order == ["a", "b"]


def test_prefill_sized_inputs_never_branch(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_DECODE_BRANCHES", "1")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert branches.enabled(torch.zeros(branches.DECODE_MAX_ROWS, 4))
    assert not branches.enabled(torch.zeros(branches.DECODE_MAX_ROWS + 1, 4))


def test_each_lane_counts_on_its_own_buffer():
    # imported here: at collection it would build arrival's Triton helper for a GPU on a GPU host, before the two
    # MoE test files that set TRITON_INTERPRET themselves are collected
    from flashnext.ops.arrival import arrival_counters, in_lane

    device = torch.device("cpu")
    main = arrival_counters(device, 10)
    with in_lane(1):
        side = arrival_counters(device, 10)
        assert arrival_counters(device, 10) is side
    assert side is not main and arrival_counters(device, 10) is main


def test_the_engine_and_models_import_no_triton():
    # The CPU tests choose Triton's interpreter when they are collected (TRITON_INTERPRET): a kernel decorated
    # before that — by a model file importing a Triton module at the top — is built for a GPU, and every
    # interpreted kernel calling it fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
    import subprocess
    import sys

    code = ("import sys, flashnext.engine.llm_engine, flashnext.models.qwen4_exp, flashnext.models.qwen3_next, "
            "flashnext.models.qwen3_5_moe, flashnext.server.app; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
