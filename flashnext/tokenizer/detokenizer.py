"""Streaming detokenization: the text each new batch of tokens adds, without re-decoding everything.

vLLM's scheme: decode only a small window of ids, of which the first read_offset were already turned
into text and serve as left context. A byte-level token can end mid-way through a UTF-8 character, which
decodes to a trailing U+FFFD; that last character is held back until later tokens complete it (or
prove it really is invalid). Every other character of the window is final, so the concatenation of
everything returned (ending with flush()) equals decode(all generated ids).
"""

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context, for decoders whose output depends on the previous token.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        # A prompt that ends mid-character would glue its bytes onto ours; start without context then.
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._sent = len(self._decode(context))  # chars of the window already returned (or context)
        self.holding = False   # the last push held a character back (its bytes may be completed by the next)

    def push(self, token_ids) -> str:
        """Append generated tokens; return the text they complete (possibly "")."""
        self._ids.extend(token_ids)
        window = self._decode(self._ids)
        complete = not window.endswith(REPLACEMENT)
        self.holding = not complete
        stable = len(window) if complete else len(window) - 1
        new_text = window[self._sent:stable] if stable > self._sent else ""
        self._sent = max(self._sent, stable)
        if complete:
            # Slide the window: the unread ids become the left context, older ids are dropped.
            del self._ids[: self._read_offset]
            self._read_offset = len(self._ids)
            self._sent = len(self._decode(self._ids))
        return new_text

    def flush(self) -> str:
        """At the end of the stream: return what is still held back (a U+FFFD for a truncated character)."""
        window = self._decode(self._ids)
        new_text = window[self._sent:]
        self._sent = len(window)
        self.holding = False
        return new_text

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
