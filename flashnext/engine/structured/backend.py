"""xgrammar against our vocabulary: checking and compiling constraints, and one matcher per request.

The vocabulary comes straight from tokenizer.json (no transformers): byte-level BPE tokens as written
there, added tokens re-encoded into the byte-level alphabet. Special added tokens (`<|im_start|>` …) are
given no text, which xgrammar reads as "never allowed", except the stop tokens, allowed exactly where the
constraint is complete. Ids the model has beyond the tokenizer (a padded embedding) are never allowed.

Compiled grammars are cached by the compiler itself, keyed by the structural tag's text: a repeated
schema or tool list compiles once.
"""
from __future__ import annotations

import json
import re
import threading
from functools import lru_cache
from pathlib import Path

import torch

from flashnext.engine.structured.grammars import StructuredOutput

_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class InvalidConstraint(ValueError):
    """The schema (or tool list) cannot be turned into a grammar; the message says why."""


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table that byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _vocab_type(tokenizer_json: dict):
    import xgrammar as xgr

    decoder = tokenizer_json.get("decoder") or {}
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {d.get("type") for d in decoders if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    raise InvalidConstraint("constrained decoding supports byte-level BPE tokenizers (Qwen's); this tokenizer's "
                            f"decoder is {sorted(k for k in kinds if k)}")


def check(spec: StructuredOutput) -> None:
    """Raise InvalidConstraint if the constraint does not make a grammar (a bad schema); no vocabulary needed."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_structural_tag(spec.structural_tag)
    except (RuntimeError, ValueError) as exc:
        raise InvalidConstraint(_clean(exc)) from None


def _clean(exc: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location; the user needs the rest."""
    return _LOCATION.sub("", str(exc).strip()).strip()


class StructuredConstraint:
    """One request's position in its grammar: which tokens may come next, and advancing by one."""

    def __init__(self, matcher, kind: str):
        self._matcher = matcher
        self.kind = kind

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    @property
    def complete(self) -> bool:
        return self._matcher.is_terminated()


class GrammarBackend:
    def __init__(self, tokenizer_file: str | Path, vocab_size: int, stop_token_ids):
        import xgrammar as xgr

        data = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
        vocab_type = _vocab_type(data)
        encoded: list[str] = [""] * vocab_size
        for token, token_id in data["model"]["vocab"].items():
            if token_id < vocab_size:
                encoded[token_id] = token
        alphabet = _byte_level_alphabet()
        stops = sorted(stop_token_ids)
        for added in data.get("added_tokens", ()):
            token_id = added["id"]
            if token_id >= vocab_size:
                continue
            if added.get("special") and token_id not in stops:
                encoded[token_id] = ""
            else:
                encoded[token_id] = "".join(alphabet[b] for b in added["content"].encode("utf-8"))
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()

    def constraint(self, spec: StructuredOutput) -> StructuredConstraint:
        import xgrammar as xgr

        try:
            with self._lock:   # requests' threads compile concurrently; the compiler's cache is one
                compiled = self.compiler.compile_structural_tag(spec.structural_tag)
        except (RuntimeError, ValueError) as exc:
            raise InvalidConstraint(_clean(exc)) from None
        return StructuredConstraint(xgr.GrammarMatcher(compiled), spec.kind)


@lru_cache(maxsize=4)
def _backend(tokenizer_file: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarBackend:
    return GrammarBackend(tokenizer_file, vocab_size, stop_token_ids)


_BACKEND_LOCK = threading.Lock()


def shared_backend(tokenizer_file: str | Path, vocab_size: int, stop_token_ids) -> GrammarBackend:
    """One backend per vocabulary, made on the first constrained request (xgrammar's import took 1.7 s on the dev
    machine); requests on several threads wait for that one rather than each building their own."""
    with _BACKEND_LOCK:
        return _backend(str(tokenizer_file), vocab_size, tuple(sorted(stop_token_ids)))


def apply_constraints(logits: torch.Tensor, constraints: list[StructuredConstraint | None]) -> None:
    """Set the logits of tokens a row's constraint forbids to -inf, in place; rows without one are untouched.

    logits: float32 [B, V] with V the model's vocabulary (= the backend's vocab_size).
    """
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(constraints), logits.shape[-1])
    for i in rows:
        constraints[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
