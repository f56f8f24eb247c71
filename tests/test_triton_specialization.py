"""The eager path's Triton kernels leave their length arguments unspecialised (docs/architecture.md: Triton compiles
again for each divisibility class of an int argument, so warm-up's compiles would not cover every prompt length).
Triton ignores a `do_not_specialize` name that is not an argument, so a renamed argument would silently bring the
recompiles back: every name must be one of its kernel's arguments."""
import importlib

import pytest

triton = pytest.importorskip("triton", reason="triton is not importable: no Triton kernels to check")

UNSPECIALISED = {
    "prefill_attention_triton._prefill_attention_kernel": {"T", "context_len", "n_chosen", "stride_ct"},
    "moe_int4_triton._gate_up_kernel": {"n_pairs"},
    "moe_int4_triton._down_kernel": {"n_pairs"},
    "qsa_scores_triton._qsa_prefill_scores_kernel": {"T", "NBLK"},
    "causal_conv1d_triton._causal_conv1d_kernel": {"T"},
    "host_gather._gather_rows_kernel": {"num_rows"},
    "rms_norm_triton._rms_norm_kernel": {"n_units"},
    "rms_norm_triton._gated_rms_norm_kernel": {"n_rows"},
    "qsa_key_append_triton._qsa_key_append_kernel": {"rows"},
    "qsa_token_lists_triton._slice_top_kernel": {"n"},
    "qsa_token_lists_triton._lists_kernel": {"n", "limit"},
    "row_copy._copy_rows_kernel": {"n"},
    "w4a16_triton._w4a16_kernel": {"M"},
}


@pytest.mark.parametrize("where", sorted(UNSPECIALISED))
def test_length_arguments_are_unspecialised(where):
    module, name = where.rsplit(".", 1)
    kernel = getattr(importlib.import_module(f"flashnext.ops.{module}"), name)
    # the JIT function holds the names (or their indices); the interpreter (CI's tests) the decorator's arguments
    listed = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
    unspecialised = {kernel.arg_names[i] if isinstance(i, int) else i for i in listed or ()}
    assert unspecialised <= set(kernel.arg_names), "a do_not_specialize name is not an argument"
    assert unspecialised == UNSPECIALISED[where]
    if hasattr(kernel, "params"):   # compiled (not interpreted): what Triton made of the list, argument by argument
        assert {p.name for p in kernel.params if p.do_not_specialize} == UNSPECIALISED[where]


def test_prefill_attention_tiles():
    """Head dim 256 on a GPU: 128 x 64 tiles in 3 stages, with a QSA selection or without (the H200 sweeps,
    BENCHMARKS.md sessions 16 and 18); the CPU interpreter's small tiles either way."""
    import torch

    from flashnext.ops.prefill_attention_triton import PrefillConfig, default_config

    assert default_config(256, torch.device("cuda")) == PrefillConfig(128, 64, 8, 3)
    assert default_config(256, torch.device("cpu")) == PrefillConfig(16, 16, 4, 1)
