"""RowTable (the PLE table) and the host-row gather: placements agree, fp8 + scale is the dequantised table, a host
table survives model.to(), and the Triton gather equals the torch reference (CPU: TRITON_INTERPRET=1; on a GPU
the table is really pinned and the rows are read over PCIe)."""
import os

import pytest
import torch
from torch import nn

from flashnext.models import build_model
from flashnext.models.layers.row_table import HOST_TABLE_BYTES, RowTable, choose_placement
from flashnext.weights.pinned import host_empty
from flashnext.ops.host_gather import gather_rows, gather_rows_triton
from flashnext.weights.config import parse_config
from flashnext.weights.presets import get_preset

FP8 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()


def fp8_table(num_rows, dim, seed=0):
    """(fp8 codes, fp32 scale, the dequantised fp32 table)."""
    values = torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(seed))
    scale = values.abs().max() / 448
    codes = (values / scale).to(FP8)
    return codes, scale, codes.float() * scale


def rows_for(num_rows, shape, seed=1):
    return torch.randint(0, num_rows, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13,), (7, 5), (3, 1, 16)])
def test_reference_is_plain_indexing(dtype, shape):
    table = torch.randn(1001, 37).to(dtype)
    rows = rows_for(1001, shape)
    got = gather_rows(table, rows, torch.float32)
    assert got.shape == (*shape, 37) and got.dtype == torch.float32
    assert torch.equal(got, table[rows].float())


def test_fp8_with_scale_equals_the_dequantised_table():
    codes, scale, dequantised = fp8_table(999, 20)
    rows = rows_for(999, (11, 16))
    table = RowTable(999, 20)
    table.set_weight(codes, scale)
    assert torch.equal(table(rows), dequantised[rows])  # fp32 by default for fp8
    assert torch.equal(table(rows, torch.bfloat16), dequantised[rows].to(torch.bfloat16))
    table.compute_dtype = torch.bfloat16
    assert table(rows).dtype == torch.bfloat16


def test_set_weight_checks_shape_and_scale():
    table = RowTable(10, 4)
    with pytest.raises(ValueError, match="shape"):
        table.set_weight(torch.zeros(10, 5))
    with pytest.raises(ValueError, match="scale"):
        table.set_weight(torch.zeros(10, 4, dtype=FP8))
    with pytest.raises(ValueError, match="scale"):
        table.set_weight(torch.zeros(10, 4), torch.tensor(1.0))


@pytest.mark.parametrize("fp8", [False, True])
def test_device_and_host_placements_give_equal_rows(fp8):
    device = "cuda" if CUDA else "cpu"
    on_device, on_host = RowTable(517, 24), RowTable(517, 24)
    if fp8:
        codes, scale, _ = fp8_table(517, 24)
        on_device.set_weight(codes.to(device), scale.to(device))
        on_host.set_weight(codes.to(device), scale.to(device))
    else:
        weight = torch.randn(517, 24)
        on_device.set_weight(weight.to(device))
        on_host.set_weight(weight.to(device))
    on_host.to_host()
    assert on_host.placement == "host" and on_host.weight.device.type == "cpu"
    assert on_host.weight.is_pinned() == CUDA
    rows = rows_for(517, (9, 16)).to(device)
    assert torch.equal(on_host(rows), on_device(rows))


class _Owner(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table, self.proj = table, nn.Linear(4, 4)


def test_host_table_stays_under_model_to():
    table = RowTable(33, 4)
    table.to_host(pin=False)
    weight = table.weight
    owner = _Owner(table).to("meta")  # on a CPU box "meta" stands in for the GPU: the move is what matters
    assert owner.proj.weight.device.type == "meta"
    assert owner.table.weight is weight and owner.table.placement == "host"
    owner.to(torch.float64)
    assert owner.proj.weight.dtype == torch.float64 and owner.table.weight.dtype == torch.float32


def test_device_tables_follow_model_to_and_fp8_keeps_its_dtype():
    plain = _Owner(RowTable(33, 4)).to(torch.float64)
    assert plain.table.weight.dtype == torch.float64  # a 16/32-bit device table behaves like nn.Embedding
    codes, scale, _ = fp8_table(33, 4)
    table = RowTable(33, 4)
    table.set_weight(codes, scale)
    owner = _Owner(table).to(torch.float64)
    assert table.weight.dtype == FP8 and table.scale.dtype == torch.float32
    owner.to("meta")
    assert table.weight.device.type == "meta" and table.scale.device.type == "meta" and table.weight.dtype == FP8


def test_choose_placement():
    assert choose_placement("auto", HOST_TABLE_BYTES + 1) == "host"
    assert choose_placement("auto", HOST_TABLE_BYTES) == "device"
    assert choose_placement("device", 1 << 40) == "device" and choose_placement("host", 1) == "host"
    with pytest.raises(ValueError, match="placement"):
        choose_placement("gpu", 1)


def test_host_empty_pins_only_on_request():
    tensor = host_empty((5, 3), torch.bfloat16, pin=False)
    assert tensor.shape == (5, 3) and tensor.device.type == "cpu" and not tensor.is_pinned()
    if CUDA:
        assert host_empty((5, 3), FP8, pin=True).is_pinned()


def test_state_dict_key_is_unchanged():
    model = build_model(parse_config(get_preset("tiny-flash-next")), device="meta")
    keys = [k for k in model.state_dict() if "ngram_embedding" in k]
    assert keys == ["model.layers.1.ple.ple_embedding.ngram_embedding.weight"]


@pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton was imported before this module could choose its interpreter")
@pytest.mark.parametrize("dim", [37, 160])
@pytest.mark.parametrize("shape", [(1,), (5, 16), (3, 7, 2)])
@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_triton_gather_equals_reference(kind, shape, dim):
    num_rows = 1009
    if kind == "fp8":
        codes, scale, _ = fp8_table(num_rows, dim)
    else:
        codes, scale = torch.randn(num_rows, dim), None
    table = host_empty((num_rows, dim), codes.dtype, pin=CUDA)
    table.copy_(codes)
    rows = rows_for(num_rows, shape)
    want = gather_rows(table, rows, torch.float32, scale)
    got = gather_rows_triton(table, rows.to("cuda" if CUDA else "cpu"), torch.float32, scale)
    assert torch.equal(got.cpu(), want)
