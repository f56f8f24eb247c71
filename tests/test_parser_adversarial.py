"""qwen3_coder generations of many calls that slip (each read a second time, value_ends.py): the work stays linear
in the text, and the result is the one the direct reading gives, however the text is streamed.

`PYTHONPATH=. python3 tests/test_parser_adversarial.py` times the parse of N slipped calls (N = 250 … 2000).
"""
import random
import re
import time

import pytest

from flashnext.server.parsers import ChatOutputParser, collect, qwen3_coder
from flashnext.server.parsers.value_ends import ENDS, ValueEnds


def tool(name, **types):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in types.items()}}}}


TOOLS = [tool("get_weather", city="string", state="string", unit="string"), tool("foo", bar="string"),
         tool("write_file", path="string", content="string"), tool("ab", a="string", b="string"),
         {"type": "function", "function": {"name": "noargs"}}]

# One call each, repeated: the first reading of each runs to the end of the text, the second closes it.
SLIPPED = {
    "undeclared-key": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=lat>\n"
                      "59.9\n</parameter>\n</function>\n</tool_call>\n",
    "missing-close": "<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=state>\nTX\n"
                     "</parameter>\n</function>\n</tool_call>\n",
    # each call leaves the earlier readings one level deeper
    "level-rises": "<tool_call>\n<function=ab>\n<parameter=a>\nx\n<parameter=b>\ny</parameter></function></tool_call>",
}


def many_tools_then_closes(n):
    """Slipped calls of 40 tools, then `</parameter>`s at ever lower levels, each followed by an undeclared KEY."""
    tools = [tool(f"t{i}", city="string", state="string") for i in range(40)]
    calls = "".join(f"<tool_call>\n<function=t{i % 40}>\n<parameter=city>\nDallas\n<parameter=state>\nTX\n"
                    "</parameter>\n</function>\n</tool_call>\n" for i in range(n))
    return calls + "</parameter> <parameter=zz>" * n, tools


TAG_SOUP = ["<tool_call>", "</tool_call>", "<function=foo>", "<function=get_weather>", "<function=ab>",
            "<function=noargs>", "<function=nope>", "</function>", "<parameter=bar>", "<parameter=city>",
            "<parameter=state>", "<parameter=a>", "<parameter=b>", "<parameter=zz>", "<parameter=", "</parameter>",
            "\n", "\n", "\n", " ", "x", "<think>", "</think>", "<parameter=\n", ">", "</tool_ca", "</para", "\t"]


def soup(rng, k):
    return "".join(rng.choices(TAG_SOUP, k=k))


def slipped_with_noise(rng):
    text = "".join(rng.choices(list(SLIPPED.values()), k=rng.randint(1, 20)))
    for _ in range(rng.randint(0, 3)):
        at = rng.randint(0, len(text))
        text = text[:at] + rng.choice(TAG_SOUP) + text[at:]
    return text


def comparable(msg):
    return msg.content, msg.reasoning, [(c.name, c.arguments) for c in msg.tool_calls]


def parse(text, tools=TOOLS, truncated=False, reasoning=False):
    return comparable(ChatOutputParser("qwen3_coder", tools, reasoning=reasoning).parse(text, truncated=truncated))


def streamed(text, pieces, tools=TOOLS, truncated=False, reasoning=False):
    parser = ChatOutputParser("qwen3_coder", tools, reasoning=reasoning)
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish(truncated=truncated)
    return comparable(collect(deltas))


def random_pieces(rng, text):
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(37, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


class CountingTags:
    """qwen3_coder's value-tag pattern, counting the characters its searches read."""

    def __init__(self):
        self.pattern, self.read = qwen3_coder._VALUE_TAGS, 0

    def search(self, text, pos):
        match = self.pattern.search(text, pos)
        self.read += (match.end() if match else len(text)) - pos
        return match

    def finditer(self, text, pos):
        self.read += len(text) - pos
        return self.pattern.finditer(text, pos)


@pytest.mark.parametrize("name", sorted(SLIPPED))
def test_slipped_calls_are_read_in_linear_work(name, monkeypatch):
    """Each call's first reading had read its last value to the end of the text: N slipped calls read ~N/2 times
    the text (2,000 calls, 226K characters: 2.9 s at finish). Now the text is read about twice, whatever N, and
    indexed once."""
    tags = CountingTags()
    monkeypatch.setattr(qwen3_coder, "_VALUE_TAGS", tags)
    built = []
    monkeypatch.setattr(qwen3_coder, "ValueEnds", lambda *args: built.append(1) or ValueEnds(*args))
    for n in (250, 500, 1000):
        text = SLIPPED[name] * n
        tags.read, built[:] = 0, []
        _, _, calls = parse(text)
        assert len(calls) == n
        assert tags.read <= 3 * len(text)
        assert len(built) == 1


def test_many_tools_then_closes_at_ever_lower_levels_read_in_linear_work(monkeypatch):
    tags = CountingTags()
    monkeypatch.setattr(qwen3_coder, "_VALUE_TAGS", tags)
    for n in (300, 600):
        text, tools = many_tools_then_closes(n)
        tags.read = 0
        assert len(parse(text, tools)[2]) == n
        assert tags.read <= 3 * len(text)


def direct_reading(monkeypatch):
    """The reference: each value read to its end (or the text's)."""
    monkeypatch.setattr(qwen3_coder.Qwen3CoderCallScanner, "_runs_to_end", lambda self, text, pos: False)


def adversarial_texts():
    rng = random.Random(11)
    texts = [one * n for one in SLIPPED.values() for n in (1, 2, 7, 60)]
    texts += [slipped_with_noise(rng) for _ in range(120)]
    texts += [soup(rng, rng.randint(1, 63)) for _ in range(600)]
    return texts


def test_same_result_as_the_direct_reading(monkeypatch):
    texts = adversarial_texts()
    many, many_tools = many_tools_then_closes(45)
    cases = [(text, TOOLS, truncated, reasoning) for text in texts for truncated in (False, True)
             for reasoning in (False, True)] + [(many, many_tools, False, False), (many, many_tools, True, False)]
    fast = [parse(*case) for case in cases]
    direct_reading(monkeypatch)
    assert [parse(*case) for case in cases] == fast


def test_streamed_the_same_as_parsed():
    rng = random.Random(5)
    for text in adversarial_texts()[::3]:
        for truncated in (False, True):
            expected = parse(text, truncated=truncated)
            for _ in range(3):
                assert streamed(text, random_pieces(rng, text), truncated=truncated) == expected, text


def runs_to_end_naively(events, first, declared):
    """The rule of value_ends.py, walked event by event from the value's first event."""
    level = 0
    for _, step, after in events[first:]:
        if step < 0 and level == 0:
            if after is ENDS or (isinstance(after, str) and (not declared or after in declared)):
                return False
        else:
            level += step
    return True


def test_value_ends_match_the_rule_walked_event_by_event():
    rng = random.Random(3)
    key_sets = [(), ("bar",), ("a", "b"), ("city", "state", "zz")]
    for _ in range(400):
        text = soup(rng, rng.randint(1, 91))
        starts = [m.end() for m in re.finditer(r"<parameter=[^<>\n]*>", text)]
        if not starts:
            continue
        cut = rng.randint(0, min(starts))  # the index may cover more than the values asked about
        events = qwen3_coder._value_events(text, cut)
        ends = ValueEnds(text, cut, events)
        suffix_at = rng.randint(0, min(starts))  # asked by a scanner holding a suffix
        for pos in starts:
            first = sum(1 for at, _, _ in events if at < pos)
            for declared in key_sets:
                assert ends.runs_to_end(text[suffix_at:], pos - suffix_at, declared) \
                    == runs_to_end_naively(events, first, declared), (text, pos, declared)


if __name__ == "__main__":
    for name, one in SLIPPED.items():
        for n in (250, 500, 1000, 2000):
            text = one * n
            began = time.perf_counter()
            calls = parse(text)[2]
            print(f"{name:15} N={n:5} {len(text):7} chars {len(calls):5} calls "
                  f"{(time.perf_counter() - began) * 1e3:7.1f} ms")
