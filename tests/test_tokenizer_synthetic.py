"""The synthetic Qwen-style tokenizer folder: special-token placement, determinism, and identical
encoding/decoding in our Tokenizer and transformers' AutoTokenizer."""

import json
import unicodedata

import pytest

from flashnext.tokenizer import Tokenizer
from flashnext.tokenizer.synthetic import QWEN_ADDED_TOKENS, write_tokenizer_files

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.\n\nI'm sure they'll say it's fine; we'd've known.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tprint(f(12345))\r\n",
    '{"name": "get_weather", "arguments": {"location": "Tokyo", "days": 3, "ok": true}}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhello<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call><|endoftext|>",
    "中文：你好，世界！日本語：こんにちは 한국어 😀👍🏽👨‍👩‍👧🇯🇵 Ελληνικά café naïve e\u0301 \u212b",
    "   leading and trailing spaces   \n \n\n   ",
    "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|image_pad|><|vision_pad|> <|im_end|>x<|im_start|>",
    "<think</think>><|im_end <tool_call <|endoftext|>",
    "Numbers 0123456789 3.14159 1e-5 $19.99 100% 2025-01-15T08:30:00Z",
]

FULL_SIZES = [(512, None), (248320, {"<|endoftext|>": 248044}), (151936, {"<|endoftext|>": 151643})]


@pytest.fixture(scope="module", params=FULL_SIZES, ids=["tiny512", "qwen35_248320", "qwen3_151936"])
def folder(request, tmp_path_factory):
    vocab_size, special_ids = request.param
    out = tmp_path_factory.mktemp(f"tok{vocab_size}")
    ids = write_tokenizer_files(out, vocab_size=vocab_size, special_token_ids=special_ids)
    return out, vocab_size, ids


def test_special_token_placement(folder):
    out, vocab_size, ids = folder
    names = [name for name, _ in QWEN_ADDED_TOKENS]
    assert list(ids) == names
    start = vocab_size - len(names) if vocab_size == 512 else ids["<|endoftext|>"]
    assert list(ids.values()) == list(range(start, start + len(names)))
    tok = Tokenizer.from_dir(out)
    for name, i in ids.items():
        assert tok.token_to_id(name) == i and tok.id_to_token(i) == name
        assert tok.encode(name) == [i]
    specials = dict(QWEN_ADDED_TOKENS)
    assert {i for name, i in ids.items() if specials[name]} == {i for i in range(tok.vocab_size) if tok.is_special(i)}
    assert not tok.is_special(ids["<think>"]) and not tok.is_special(ids["</tool_call>"])
    assert tok.is_special(ids["<|im_end|>"])
    assert tok.eos_token_ids == {ids["<|im_end|>"]} and tok.pad_token_id == ids["<|endoftext|>"]
    # Every id of the model's vocabulary has a visible string, so random-weight models stream text.
    assert tok.vocab_size == vocab_size
    assert all(tok.id_to_token(i) for i in range(0, vocab_size, 997))
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["eos_token"] == "<|im_end|>"


def test_tiny_vocab_is_full(tmp_path):
    write_tokenizer_files(tmp_path, vocab_size=512)
    tok = Tokenizer.from_dir(tmp_path)
    assert all(tok.id_to_token(i) is not None for i in range(512))
    # Trained merges make common words single tokens, so tokenization is realistic.
    assert len(tok.encode(" the")) == 1
    assert len(tok.encode(TEXTS[2])) < len(TEXTS[2].encode()) * 0.7


def test_deterministic(tmp_path):
    write_tokenizer_files(tmp_path / "a", vocab_size=248320, special_token_ids={"<|endoftext|>": 248044})
    write_tokenizer_files(tmp_path / "b", vocab_size=248320, special_token_ids={"<|endoftext|>": 248044})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_round_trip(folder):
    tok = Tokenizer.from_dir(folder[0])
    for text in TEXTS:
        ids = tok.encode(text)
        # NFC normalisation is the one intended change (e + combining acute -> é, Angstrom sign -> Å).
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_matches_transformers(folder):
    transformers = pytest.importorskip("transformers")
    out, _, _ = folder
    ours = Tokenizer.from_dir(out)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf.eos_token_id == ours.eos_token_id
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(vocab_size=200), "ids below the special tokens"),
        (dict(vocab_size=512, special_token_ids={"<|endoftext|>": 500}), "outside"),
        (dict(vocab_size=512, special_token_ids={"<|im_start|>": 300}), "first of the block"),
        (dict(vocab_size=512, special_token_ids={"<|bogus|>": 300}), "unknown"),
        (dict(vocab_size=512, tool_format="mistral"), "tool_format"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_tokenizer_files(tmp_path, **kwargs)
