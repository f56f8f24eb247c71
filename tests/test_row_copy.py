"""RowCopier (one Triton launch, interpreted on CPU) against copy_table_rows, the torch reference: tables of
different dtypes and row shapes, rows in any order, and rows of other tables left alone."""
import pytest
import torch

from flashnext.ops.row_copy import RowCopier, copy_table_rows


def tables_pair(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [((7, 16, 4), torch.int32), ((7, 3, 40), torch.bfloat16), ((7, 8200), torch.float32)]
    sources = [torch.randint(-100, 100, shape, generator=g).to(dtype) for shape, dtype in shapes]
    destinations = [torch.zeros((5, *s.shape[1:]), dtype=s.dtype) for s in sources]
    return sources, destinations


def test_copies_equal_the_reference():
    sources, destinations = tables_pair(0)
    expected = [d.clone() for d in destinations]
    tables = torch.tensor([0, 2, 1, 0, 2, 2])
    source_rows = torch.tensor([6, 0, 3, 2, 5, 1])
    destination_rows = torch.tensor([4, 1, 0, 0, 3, 2])
    copy_table_rows(sources, expected, tables, source_rows, destination_rows)
    RowCopier(sources, destinations).copy(tables, source_rows, destination_rows)
    for got, want in zip(destinations, expected):
        assert torch.equal(got, want)
    assert not destinations[1][1:].any(), "rows nobody asked for were written"
    assert torch.equal(destinations[2][3], sources[2][5])   # 4,100 words: parts loop more than once


def test_nothing_to_copy_and_bad_rows():
    sources, destinations = tables_pair(1)
    RowCopier(sources, destinations).copy(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                          torch.zeros(0, dtype=torch.long))
    assert not any(d.any() for d in destinations)
    with pytest.raises(ValueError, match="multiples of 8 bytes"):
        RowCopier([torch.zeros(4, 6, dtype=torch.uint8)], [torch.zeros(2, 6, dtype=torch.uint8)])
    with pytest.raises(AssertionError, match="row shape"):
        RowCopier([torch.zeros(4, 8)], [torch.zeros(2, 4)])
