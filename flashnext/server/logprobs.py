"""Engine logprobs in OpenAI's two shapes: chat (`content: [{token, logprob, bytes, top_logprobs}]`) and
legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""
from __future__ import annotations

import math

from flashnext.engine.outputs import TokenLogprob
from flashnext.tokenizer.detokenizer import REPLACEMENT, IncrementalDetokenizer

_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a number


def _finite(value: float) -> float:
    return _FLOOR if math.isinf(value) or math.isnan(value) else max(value, _FLOOR)


class TokenTexts:
    """Token id -> the text it stands for, decoded once per request."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts, top_k: int) -> dict:
    def item(token_id, logprob):
        text = texts(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top[:top_k]]} for e in entries],
            "refusal": None}


class TextOffsets:
    """Where each generated token's text starts in its choice's text (`text_offset`): the choice's tokens through an
    incremental detokenizer as the engine's (the same prompt context and skip_special_tokens), so that a special token
    the text skips, or bytes of a character split over tokens, move the offset as they move the text — a token's own
    decoded string (`tokens`) is no measure of either."""

    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._length = 0

    def of(self, token_ids) -> list[int]:
        offsets = []
        for token_id in token_ids:
            held = self._detokenizer.holding
            added = self._detokenizer.push([token_id])
            # A character held back (bytes a later token might complete) that this token proves invalid comes out
            # as U+FFFD ahead of this token's own text: it is the earlier token's.
            offsets.append(self._length + (1 if held and added.startswith(REPLACEMENT) else 0))
            self._length += len(added)
        return offsets


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, top_k: int, offsets: TextOffsets) -> dict:
    tokens, token_logprobs, tops = [], [], []
    for e in entries:
        tokens.append(texts(e.token_id))
        token_logprobs.append(_finite(e.logprob))
        top = {texts(t): _finite(lp) for t, lp in e.top[:top_k]}
        tops.append(top or None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets.of([e.token_id for e in entries])}
