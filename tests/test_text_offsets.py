"""TextOffsets (legacy completions' text_offset) against byte-level tokens: each token is one byte here, so a
character split over tokens, or bytes that never form one, move the text the way a byte-level BPE's do."""
from flashnext.server.logprobs import TextOffsets


class ByteTokenizer:
    """Token id = one byte; decoding replaces invalid UTF-8 with U+FFFD, as HF byte-level decoders do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def offsets_and_text(data: bytes) -> tuple[list[int], str]:
    offsets = TextOffsets(ByteTokenizer(), [], skip_special_tokens=True)
    return offsets.of(list(data)), data.decode("utf-8", errors="replace")


def test_each_offset_points_at_the_character_its_byte_belongs_to():
    """A byte that starts or continues a valid character points at that character; a byte after bytes proven
    invalid points past their U+FFFD — also when its own bytes are an incomplete character (E4 BD, then E5 A5),
    where a rule reading only the returned text would point one early."""
    cases = {
        b"ab": [0, 1],
        "é".encode() + b"x": [0, 0, 1],                  # two bytes of one character, then x after it
        b"\xe4\xbd" + b"x": [0, 0, 1],                   # E4 BD proven invalid by x: one U+FFFD, x after it
        b"\xe4\xbd\xe5\xa5": [0, 0, 1, 1],               # E4 BD invalid, then E5 A5 (held, never completed)
        b"\xe4\xbd\xe5\xa5\xbd": [0, 0, 1, 1, 1],        # ... completed by BD: 好 after the U+FFFD
        b"\xff\xfe": [0, 1],                             # invalid bytes each their own U+FFFD
    }
    for data, expected in cases.items():
        offsets, text = offsets_and_text(data)
        assert offsets == expected, (data, offsets, text)
        assert all(0 <= o < len(text) for o in offsets)


class TableTokenizer:
    """Token id → bytes from a table (multi-byte tokens, as a byte-level BPE's are)."""

    def __init__(self, table: dict[int, bytes]):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")


def test_multi_byte_tokens_and_offsets_asked_a_chunk_at_a_time():
    """A token that completes a character another token began points at that character; asked token by token (as
    a stream asks, chunk by chunk) the offsets are those of the whole reply."""
    table = {1: b"\xe4\xbd", 2: b"\xa0x", 3: b"\xe5", 4: b"\xa5\xbd!", 5: b"\xff", 6: b"ab"}
    ids = [6, 1, 2, 3, 4, 5, 5, 6]
    text = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
    assert text == "ab你x好!\ufffd\ufffdab"
    whole = TextOffsets(TableTokenizer(table), [], skip_special_tokens=True).of(ids)
    assert whole == [0, 2, 2, 4, 4, 6, 7, 8]
    stream = TextOffsets(TableTokenizer(table), [], skip_special_tokens=True)
    assert [o for i in ids for o in stream.of([i])] == whole
