"""Stop strings: the same output however the text is cut into tokens, and no stop text ever emitted."""
from __future__ import annotations

import itertools

import pytest

from flashnext.engine.stop_strings import StopStringMatcher

CASES = [  # text, stop strings
    ("Hello world</s> trailing", ["</s>"]),
    ("abcabd and more", ["abd"]),
    ("aaab", ["aab"]),
    ("xyz", ["yzq"]),
    ("the end. STOP here", ["STOP", "end"]),
    ("abcd", ["abcd", "bc"]),
    ("xabcd", ["cd", "bcd"]),
    ("héllo 世界! 世界", ["世界", "界!"]),
    ("STOPabc", ["STOP"]),
    ("no stop in here", ["zz", "qq"]),
    ("plain", []),
    ("a\n\nUser: hi", ["\n\nUser:", "\nUser"]),
]


def expected(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    found = [(text.find(s) + len(s), -len(s), s) for s in stop if s in text]
    if not found:
        return text, None
    end, _, s = min(found)
    return text[:end] if include else text[:end - len(s)], s


def splits(text: str):
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, n), 2):
        yield [text[:i], text[i:j], text[j:]]


def stream(chunks: list[str], stop: list[str], include: bool) -> tuple[str, str | None]:
    m = StopStringMatcher(stop, include)
    out = ""
    for chunk in chunks:
        emitted, matched = m.feed(chunk)
        out += emitted
        if not include:
            assert not any(s in out for s in stop)
        if matched is not None:
            return out, matched
    return out + m.flush(), None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text,stop", CASES)
def test_every_split_gives_the_unsplit_result(text, stop, include):
    want = expected(text, stop, include)
    for chunks in splits(text):
        assert stream(chunks, stop, include) == want, chunks


def test_partial_stop_is_held_back_until_it_fails():
    m = StopStringMatcher(["</s>"])
    assert m.feed("abc</") == ("abc", None)
    assert m.feed("p>") == ("</p>", None)
    assert m.feed("x<") == ("x", None)
    assert m.flush() == "<"


def test_include_stop_str_emits_eagerly():
    m = StopStringMatcher(["</s>"], include_stop_str_in_output=True)
    assert m.feed("abc</") == ("abc</", None)
    assert m.feed("s>tail") == ("s>", "</s>")
    assert m.done
