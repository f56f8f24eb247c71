"""The transposed-tile INT4 MoE kernels (ops/moe_int4_swapped_triton.py) against the torch reference, under the
Triton interpreter on the CPU (scripts/gpu_moe.py --prefill checks them at Flash-Next sizes on the GPU)."""
import pytest
import torch

from flashnext.ops.moe_int4 import moe_int4_reference
from oracle import rel_err
from test_moe_int4 import case

pytest.importorskip("triton", reason="triton is not importable: the INT4 MoE kernels are not tested")


def test_swizzle_columns_puts_nibble_j_of_word_i_at_j_sub_plus_i():
    from flashnext.ops.moe_int4_swapped_triton import swizzle_columns

    x = torch.arange(2 * 64).view(2, 64)
    got = swizzle_columns(x, 32)          # blocks of 32 columns: words i < 4, nibbles j < 8
    block, i, j = 1, 3, 5
    assert got[1, block * 32 + j * 4 + i] == x[1, block * 32 + 8 * i + j]
    assert sorted(got[0].tolist()) == x[0].tolist()


# (M, k, H, I, g for gate_up, g for down, asym, block_m, block_n): runs cut into blocks, a half-masked N tile (I = 48),
# gate|up and down with different group sizes (h's column order is the down kernel's)
CASES = [
    (33, 3, 64, 48, 32, 16, True, 16, 32),
    (40, 2, 96, 32, 32, 32, False, 16, 32),
    (17, 3, 64, 64, 64, 32, False, 32, 64),
    (5, 2, 64, 32, 64, 32, True, 16, 32),
    (300, 4, 128, 64, 128, 64, True, None, None),    # the tiles config_for picks (150 rows an expert: 128)
]


@pytest.mark.parametrize("m,k,h,i,g_up,g_down,asym,block_m,block_n", CASES)
def test_swapped_equals_reference(m, k, h, i, g_up, g_down, asym, block_m, block_n):
    from flashnext.ops.moe_int4_swapped_triton import SwappedConfig, moe_int4_swapped, runs_swapped

    x, ids, weights, w_gate_up, w_down = case(m, 8, k, h, i, g_up, g_down, asym)
    assert runs_swapped(w_gate_up, w_down, x.device)
    config = None if block_m is None else SwappedConfig(block_m=block_m, block_n=block_n)
    got = moe_int4_swapped(x, ids, weights, w_gate_up, w_down, config)
    assert rel_err(got, moe_int4_reference(x, ids, weights, w_gate_up, w_down)) < 1e-5


def test_tiles_hold_the_rows_an_expert():
    """config_for: the smallest measured block of rows that holds the average rows an expert, the largest past it."""
    from flashnext.ops.moe_int4_swapped_triton import TILES, config_for

    assert config_for(2.5).block_m == 16 and config_for(16).block_m == 16 and config_for(16.1).block_m == 32
    assert config_for(80).block_m == 128 and config_for(1000) == TILES[128]


def test_act_order_and_small_groups_on_a_gpu_are_not_taken():
    from flashnext.ops.moe_int4_swapped_triton import runs_swapped

    _, _, _, w_gate_up, w_down = case(5, 8, 2, 64, 32, 32, 32, act_order=True)
    assert not runs_swapped(w_gate_up, w_down, torch.device("cpu"))
    _, _, _, w_gate_up, w_down = case(5, 8, 2, 256, 128, 128, 64)
    assert not runs_swapped(w_gate_up, w_down, torch.device("cuda"))     # down's groups of 64
    _, _, _, w_gate_up, w_down = case(5, 8, 2, 256, 128, 128, 128)
    assert runs_swapped(w_gate_up, w_down, torch.device("cuda"))
