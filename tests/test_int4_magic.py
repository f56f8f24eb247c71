"""The magic-number INT4 dequantisation (ops/int4_magic.py): its constants and bit layout (the magic, −(magic +
zero) as the kernels build it, the lanes), stepped through in torch, give exactly the plain conversion — (q − zero) × scale in fp32, rounded to the dtype — for every nibble, zero point
and both halves of a word. (The PTX runs on the GPU only: scripts/gpu_moe.py --magic compares the kernels' bits.)"""
import pytest
import torch

from flashnext.ops.int4_magic import magic_dequant, magic_pair_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_magic_pairs_equal_the_plain_dequantisation(dtype):
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (17, 64), generator=gen, dtype=torch.int64).to(torch.int32)
    words[0] = torch.tensor(0x76543210, dtype=torch.int32)            # every nibble value in one word, twice
    words[1] = torch.tensor(-0x789ABCE, dtype=torch.int32)            # 0xF8765432: sign bit set
    zero = torch.randint(0, 17, (17, 64), generator=gen)              # 0..16: the stored zero points' range
    scale = (torch.randn(17, 64, generator=gen) * 1e-2).to(dtype)     # signed, as GPTQ scales may be
    scale[2, :4] = torch.tensor([0.0, -0.0, 3.0e4 if dtype == torch.float16 else 1e30, 1e-3])
    for j in range(4):
        low, high = magic_pair_reference(words, j, zero, scale)
        for got, nibble in ((low, j), (high, j + 4)):
            q = (words >> (4 * nibble)) & 0xF
            want = ((q - zero).to(torch.float32) * scale.to(torch.float32)).to(dtype)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (j, nibble)


def test_the_trick_is_taken_only_where_it_is_exact_and_compiled(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert magic_dequant(torch.bfloat16, cuda, torch.bfloat16) and magic_dequant(torch.float16, cuda, torch.float16)
    assert not magic_dequant(torch.bfloat16, cuda, torch.bfloat16, torch.float16)     # fp16 scales would round to bf16
    assert not magic_dequant(torch.float32, cuda, torch.float32)
    assert not magic_dequant(torch.bfloat16, torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("FLASHNEXT_INT4_MAGIC", "0")
    assert not magic_dequant(torch.bfloat16, cuda, torch.bfloat16)
    monkeypatch.setenv("FLASHNEXT_INT4_MAGIC", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")                       # the interpreter runs no PTX
    assert not magic_dequant(torch.bfloat16, cuda, torch.bfloat16)
