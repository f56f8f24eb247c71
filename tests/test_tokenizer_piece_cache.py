"""PieceCache (tokenizer/piece_cache.py) gives exactly the tokenizer's own ids for long texts cut at added tokens,
encodes a piece once, keeps its memory bound, and never cuts at a token that strips its neighbours' whitespace."""
import random

import pytest
import tokenizers

from flashnext.tokenizer.piece_cache import PieceCache, _size, split_points
from flashnext.tokenizer.synthetic import write_tokenizer_files

from test_tokenizer_synthetic import TEXTS


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(out, vocab_size=248320, special_token_ids={"<|endoftext|>": 248044})
    return tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))


def conversation(seed: int, turns: int) -> list[str]:
    """Chat renders of growing conversations, messages from the tokenizer tests' hard texts (specials inside
    messages, whitespace at their edges, text NFC changes, emoji)."""
    rng = random.Random(seed)
    text, renders = "", []
    for _ in range(turns):
        for role in ("user", "assistant"):
            body = "".join(rng.choice(TEXTS) + rng.choice(["", " ", "\n", "  \n"]) for _ in range(rng.randrange(1, 6)))
            text += f"<|im_start|>{role}\n{body}<|im_end|>\n"
        renders.append(text + "<|im_start|>assistant\n")
    return renders


def reference(backend, text):
    return backend.encode(text, add_special_tokens=False).ids


def test_long_texts_equal_the_tokenizer(backend):
    cache = PieceCache(backend, min_chars=0)
    for seed in range(4):
        for text in conversation(seed, 8):
            assert cache.encode(text) == reference(backend, text)
    for text in TEXTS:
        assert cache.encode(text) == reference(backend, text)


def test_a_piece_is_encoded_once(backend, monkeypatch):
    cache = PieceCache(backend, min_chars=0)
    renders = conversation(7, 6)
    cache.encode(renders[-2])
    encoded = []
    original = backend.encode_batch
    monkeypatch.setattr(cache, "backend", type("Spy", (), {
        "encode_batch": lambda self, pieces, **kw: encoded.extend(pieces) or original(pieces, **kw),
        "encode": backend.encode})())
    assert cache.encode(renders[-1]) == reference(backend, renders[-1])
    # only the newest turn's messages (and the generation prompt's short piece) are encoded again
    assert encoded and sum(map(len, encoded)) <= len(renders[-1]) - len(renders[-2]) + len("assistant\n")


def test_memory_is_bounded(backend):
    cache = PieceCache(backend, min_chars=0, max_bytes=4000)
    for text in conversation(3, 10):
        assert cache.encode(text) == reference(backend, text)
        assert cache.bytes <= 4000 or len(cache.pieces) == 1
    assert cache.bytes == sum(_size(text, ids) for text, ids in cache.pieces.items())


def test_no_cut_at_tokens_that_strip_whitespace(backend):
    backend = tokenizers.Tokenizer.from_str(backend.to_str())
    backend.add_special_tokens([tokenizers.AddedToken("<strip>", lstrip=True, rstrip=True)])
    assert "<strip>" not in split_points(backend) and "<|im_start|>" in split_points(backend)
    cache = PieceCache(backend, min_chars=0)
    for text in ["a  <strip>  b<|im_end|> c <strip>\n", "x <|im_start|>  <strip> y"]:
        assert cache.encode(text) == reference(backend, text)


def test_tokenizers_that_do_not_compose_are_not_cut(backend):
    # A word-level tokenizer whose pre-tokenizer marks the text's first word apart (Metaspace, prepend "first"):
    # "a b<|im_end|>a b" is ▁a ▁b <|im_end|> a ▁b whole, but its second piece alone would start ▁a.
    vocab = {"[UNK]": 0, "▁a": 1, "a": 2, "▁b": 3, "b": 4}
    metaspace = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    metaspace.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    metaspace.add_special_tokens(["<|im_end|>"])
    text = "a b<|im_end|>a b"
    assert reference(metaspace, text) != reference(metaspace, "a b") + [5] + reference(metaspace, "a b")
    padded = tokenizers.Tokenizer.from_str(backend.to_str())
    padded.enable_padding(length=64)
    for other, text in ((metaspace, text), (padded, conversation(5, 2)[-1])):
        cache = PieceCache(other, min_chars=0)
        assert cache.pattern is None
        assert cache.encode(text) == reference(other, text)
    assert PieceCache(backend).pattern is not None
