"""Encode a long prompt a piece at a time, remembering the pieces.

An agent re-sends its whole conversation every turn, and the server encodes it whole: 140 KB of chat (42K tokens)
took 80–120 ms on the dev machine, on the request's way to its first token, though all but the newest messages had
been encoded the turn before. HF tokenizers split a text at its added tokens before anything else and run the
normalizer, pre-tokenizer and model on each piece between them on its own, so the ids of a text are its pieces'
ids with the added tokens' ids between them — wherever an added token neither strips the whitespace beside it
(lstrip / rstrip), nor matches only as a whole word, nor is matched in normalized text. Chat templates wrap every
message in such tokens (<|im_start|>, <|im_end|>), so the pieces are about the messages: a piece seen before is
looked up, the new ones are encoded together (encode_batch: on several threads).
Not every tokenizer composes so: one that pads or truncates, or whose pre-tokenizer treats the text's first
piece apart (Metaspace with prepend_scheme "first"), would not. So the cache is used only when the tokenizer
neither pads nor truncates and a probe — texts cut around each cut token — encodes the same whole and in pieces.
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

import tokenizers

MIN_CHARS = 4096          # shorter texts: one encode call, no split
MAX_BYTES = 128 << 20     # the pieces kept, text and ids (least recently used out first)


def split_points(backend: tokenizers.Tokenizer) -> dict[str, int]:
    """The added tokens a text can be cut at without changing its ids (module docstring): content → id. One that
    lies inside another added token is left out, so that the longest match, as the tokenizer takes it, never
    straddles a cut."""
    added = backend.get_added_tokens_decoder()
    clean = {t.content: i for i, t in added.items() if not (t.lstrip or t.rstrip or t.single_word or t.normalized)}
    return {c: i for c, i in clean.items()
            if not any(c != t.content and c in t.content for t in added.values())}


def _size(text: str, ids: array) -> int:
    """Bytes a kept piece holds, about: its text (1 byte a character, up to 4 outside ASCII) and its ids."""
    return len(text) * (1 if text.isascii() else 4) + ids.itemsize * len(ids)


class PieceCache:
    def __init__(self, backend: tokenizers.Tokenizer, min_chars: int = MIN_CHARS, max_bytes: int = MAX_BYTES):
        self.backend, self.min_chars, self.max_bytes = backend, min_chars, max_bytes
        self.token_ids = split_points(backend)
        contents = sorted(self.token_ids, key=len, reverse=True)   # longest first: the longest match wins
        self.pattern = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        if self.pattern is not None and not self._composes():
            self.pattern = None
        self.pieces: OrderedDict[str, array] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()   # the server encodes on worker threads

    def _composes(self) -> bool:
        """Whether this tokenizer encodes texts cut at the cut tokens piece by piece (module docstring)."""
        if self.backend.padding is not None or self.backend.truncation is not None:
            return False
        words = ["a b", "a b", " a b ", "\n x\n", "é1 2"]   # a piece the same first and after a cut
        for token in self.token_ids:
            text = token.join(words) + token
            pieces = self.backend.encode_batch(words, add_special_tokens=False)
            cut = [i for p in pieces for i in p.ids + [self.token_ids[token]]]
            if self.backend.encode(text, add_special_tokens=False).ids != cut:
                return False
        return True

    def encode(self, text: str) -> list[int]:
        """backend.encode(text, add_special_tokens=False).ids"""
        if self.pattern is None or len(text) < self.min_chars:
            return self.backend.encode(text, add_special_tokens=False).ids
        parts = self.pattern.split(text)    # text, token, text, …, text
        with self.lock:
            new = list(dict.fromkeys(p for p in parts[0::2] if p and p not in self.pieces))
        encoded = {p: array("i", e.ids)
                   for p, e in zip(new, self.backend.encode_batch(new, add_special_tokens=False))} if new else {}
        ids = array("i")
        with self.lock:
            for i, part in enumerate(parts):
                if i % 2:
                    ids.append(self.token_ids[part])
                elif part:
                    piece = self.pieces.get(part)
                    if piece is not None:
                        self.pieces.move_to_end(part)
                    else:   # new, or evicted by another thread since the first look
                        piece = encoded.get(part)
                        if piece is None:
                            piece = array("i", self.backend.encode(part, add_special_tokens=False).ids)
                        self.pieces[part] = piece
                        self.bytes += _size(part, piece)
                    ids.extend(piece)
            while self.bytes > self.max_bytes and len(self.pieces) > 1:
                self.bytes -= _size(*self.pieces.popitem(last=False))
        return ids.tolist()
