"""Streaming detokenization equals decoding everything at once, and never shows a U+FFFD for a
character whose bytes are still arriving."""

import random

import pytest

from flashnext.tokenizer import IncrementalDetokenizer, Tokenizer
from flashnext.tokenizer.synthetic import write_tokenizer_files

TEXTS = [
    "Hello, world! The quick brown fox.",
    "中文：你好，世界！今天天气很好。日本語：こんにちは。한국어: 안녕하세요",
    "Emoji 😀😂👍🏽 family 👨‍👩‍👧 flag 🇯🇵 and 🚀🔥✅🤖 — fin. Ελληνικά naïve",
    "<think>\nLet me think 🤔 about 你好.\n</think>\n\nAnswer<tool_call>\n<function=f>\n</function>\n</tool_call>"
    "<|im_end|><|endoftext|>",
    "\U0001f9ea\U00010348\u20ac\u00a2$ mixed 1-2-3-4 byte chars \U0001f9ea\U00010348\u20ac\u00a2$",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("detok")
    write_tokenizer_files(out, vocab_size=512)
    return Tokenizer.from_dir(out)


def stream(tok, ids, prompt_ids=(), skip=True, chunks=None, rng=None):
    """Push ids in chunks (sizes from rng, or one at a time); return the pieces and the flush."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        pieces.append(detok.push(ids[i:i + n]))
        i += n
    return pieces, detok.flush(), detok


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_text_streams(tok, text, skip):
    ids = tok.encode(text)
    # The byte-level tokens really do split characters, or this test would prove nothing.
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids) or text.isascii()
    for rng in (None, random.Random(0), random.Random(1)):
        pieces, tail, _ = stream(tok, ids, skip=skip, rng=rng)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
        assert tail == ""
        assert not any("\ufffd" in piece for piece in pieces)  # valid UTF-8: nothing to replace


def test_prompt_context(tok):
    prompt = tok.encode("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("好的 😀 sure")
    pieces, tail, _ = stream(tok, ids, prompt_ids=prompt)
    assert "".join(pieces) + tail == tok.decode(ids)
    # A prompt that ends half-way through a character must not leak its bytes into the output.
    cut = tok.encode("🤖")[:-1]
    pieces, tail, _ = stream(tok, ids, prompt_ids=tok.encode("hi ") + cut)
    assert "".join(pieces) + tail == tok.decode(ids)


@pytest.mark.parametrize("seed", range(6))
def test_random_token_streams(tok, seed):
    """Arbitrary ids (lone continuation bytes, truncated characters, specials) still concatenate to
    the full decode, and a held-back U+FFFD is only released once it is final."""
    rng = random.Random(seed)
    high_bytes = [i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "")[:1] >= "\u00a1"]
    for _ in range(20):
        n = rng.randint(1, 60)
        ids = [rng.choice(high_bytes) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) for _ in range(n)]
        skip = rng.random() < 0.5
        pieces, tail, _ = stream(tok, ids, skip=skip, rng=rng if seed % 2 else None)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == full
        emitted = "".join(pieces)
        assert full.startswith(emitted) and len(full) - len(emitted) <= 1  # at most the last char held


def test_incomplete_character_is_held_back(tok):
    ids = tok.encode("a😀b")
    assert len(ids) >= 4  # the emoji takes several byte tokens
    detok = IncrementalDetokenizer(tok, [], True)
    pieces = [detok.push([i]) for i in ids]
    assert pieces == ["a"] + [""] * (len(ids) - 3) + ["😀", "b"]
    detok = IncrementalDetokenizer(tok, [], True)
    assert "".join(detok.push([i]) for i in tok.encode("x🤖")[:-1]) == "x"
    assert detok.flush() == "\ufffd"  # the stream ended mid-character: now it is final


def test_window_stays_small(tok):
    ids = tok.encode(" ".join(TEXTS) * 20)
    _, _, detok = stream(tok, ids)
    assert len(detok._ids) <= 8  # old tokens are dropped, so each push decodes a few tokens only
