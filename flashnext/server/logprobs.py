"""Engine logprobs in OpenAI's two shapes: chat (`content: [{token, logprob, bytes, top_logprobs}]`) and
legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""
from __future__ import annotations

import math

from flashnext.engine.outputs import TokenLogprob

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


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, top_k: int, offset: int) -> dict:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = texts(e.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(e.logprob))
        top = {texts(t): _finite(lp) for t, lp in e.top[:top_k]}
        tops.append(top or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
