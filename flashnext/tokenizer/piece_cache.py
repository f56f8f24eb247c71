"""Encode a long prompt a piece at a time, remembering the pieces.

An agent re-sends its whole conversation every turn, and the server encodes it whole: 140 KB of chat (42K tokens)
took 80–120 ms on the dev machine, on the request's way to its first token, though all but the newest messages had
been encoded the turn before. HF tokenizers split a text at its added tokens before anything else and run the
normalizer, pre-tokenizer and model on each piece between them on its own, so the ids of a text are its pieces'
ids with the added tokens' ids between them — wherever an added token neither strips the whitespace beside it
(lstrip / rstrip), nor matches only as a whole word, nor is matched in normalized text. Chat templates wrap every
message in such tokens (<|im_start|>, <|im_end|>), so the pieces are about the messages: a piece seen before is
looked up, the new ones are encoded together (encode_batch: on several threads).
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

import tokenizers

MIN_CHARS = 4096          # shorter texts: one encode call, no split
MAX_TOKENS = 16 << 20     # the pieces kept (least recently used out first): ~64 MB of ids


def split_points(backend: tokenizers.Tokenizer) -> dict[str, int]:
    """The added tokens a text can be cut at without changing its ids (module docstring): content → id. One that
    lies inside another added token is left out, so that the longest match, as the tokenizer takes it, never
    straddles a cut."""
    added = {i: t for i, t in backend.get_added_tokens_decoder().items()}
    clean = {t.content: i for i, t in added.items() if not (t.lstrip or t.rstrip or t.single_word or t.normalized)}
    return {c: i for c, i in clean.items()
            if not any(c != t.content and c in t.content for t in added.values())}


class PieceCache:
    def __init__(self, backend: tokenizers.Tokenizer, min_chars: int = MIN_CHARS, max_tokens: int = MAX_TOKENS):
        self.backend, self.min_chars, self.max_tokens = backend, min_chars, max_tokens
        self.token_ids = split_points(backend)
        contents = sorted(self.token_ids, key=len, reverse=True)   # longest first: the longest match wins
        self.pattern = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self.pieces: OrderedDict[str, array] = OrderedDict()
        self.tokens = 0
        self.lock = threading.Lock()   # the server encodes on worker threads

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
                        self.tokens += len(piece)
                    ids.extend(piece)
            while self.tokens > self.max_tokens and len(self.pieces) > 1:
                self.tokens -= len(self.pieces.popitem(last=False)[1])
        return ids.tolist()
