"""Deterministic, varied filler text and the prompts built from it, sized in tokens.

Filler must not be one repeated sentence: a tokenizer would give it an unusual tokens-per-word ratio and a
model with a repetition-friendly prefix cache or n-gram table could behave unlike real traffic.
"""
from __future__ import annotations

import random
import uuid

# Tokens per word of English prose under a ~150K-vocabulary BPE (Qwen's): the estimate used when the
# server has no /tokenize, reported as estimated.
ESTIMATED_TOKENS_PER_WORD = 1.35

ESSAY_PROMPT = ("Write an essay of about 800 words on how the printing press changed science, religion and "
                "politics in early modern Europe. Use several paragraphs and concrete examples.")
QUICKSORT_PROMPT = ("Write a quicksort implementation in Python that sorts a list in place. Comment every "
                    "line to explain what it does, then explain its average and worst-case complexity.")
DECODE_PROMPTS = {"essay": ESSAY_PROMPT, "quicksort": QUICKSORT_PROMPT}

_SUBJECTS = ["the committee", "a river pilot", "the old library", "our compiler", "the harvest", "a glacier",
             "the orchestra", "each neuron", "the city council", "a merchant ship", "the telescope",
             "the spreadsheet", "a beekeeper", "the railway", "the vaccine trial", "a chess engine",
             "the lighthouse", "the bakery", "a satellite", "the archive", "the storm front", "a locksmith"]
_VERBS = ["reviewed", "measured", "postponed", "rebuilt", "described", "questioned", "predicted", "traded",
          "translated", "repaired", "surveyed", "celebrated", "rejected", "simplified", "documented",
          "borrowed", "calibrated", "ignored", "compared", "financed", "painted", "recorded"]
_OBJECTS = ["the northern bridge", "seventeen proposals", "a quiet experiment", "the winter schedule",
            "an unusual alloy", "the tax ledgers", "a coastal map", "three forgotten letters",
            "the migration routes", "a memory leak", "the copper mines", "a folk melody", "the tide tables",
            "a broken gearbox", "the election results", "an herbal remedy", "the sorting network",
            "a mountain pass", "the wool prices", "a faded photograph", "the orbital period"]
_TAILS = ["before the first frost", "with unexpected care", "after a long debate", "for the third time",
          "despite the rain", "under a tight budget", "while the market slept", "in about {n} minutes",
          "at {n} degrees", "for {n} crowns", "near kilometre {n}", "during the {n}th session",
          "without any witnesses", "as the records show", "in the archive of {y}", "by the spring of {y}"]
_CONNECTORS = ["Meanwhile,", "Later,", "In contrast,", "As a result,", "Surprisingly,", "Some say", "Still,",
               "Even so,", "Around then,", "Oddly,"]


def _sentence(rng: random.Random) -> str:
    tail = rng.choice(_TAILS).format(n=rng.randint(2, 999), y=rng.randint(1450, 2030))
    lead = f"{rng.choice(_CONNECTORS)} " if rng.random() < 0.3 else ""
    s = f"{lead}{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {tail}."
    return s[0].upper() + s[1:]


def varied_text(n_words: int, seed: int) -> str:
    """About `n_words` words of prose in paragraphs, the same for the same seed."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    words = 0
    while words < n_words:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            s = _sentence(rng)
            sentences.append(s)
            words += s.count(" ") + 1
            if words >= n_words:
                break
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def fresh_salt() -> str:
    """A random first line that no earlier request shares, so the prefix cache cannot hit."""
    return f"Session {uuid.uuid4().hex}."


class TextSizer:
    """Turns a token budget into filler text, by the server's tokenizer when it has /tokenize."""

    def __init__(self, tokens_per_word: float = ESTIMATED_TOKENS_PER_WORD, measured: bool = False):
        self.tokens_per_word = tokens_per_word
        self.measured = measured

    @classmethod
    async def calibrate(cls, client) -> "TextSizer":
        sample = varied_text(3000, seed=12345)
        count = await client.count_tokens(sample)
        if not count:
            return cls()
        return cls(count / len(sample.split()), measured=True)

    def words_for(self, n_tokens: int) -> int:
        return max(1, round(n_tokens / self.tokens_per_word))

    def filler(self, n_tokens: int, seed: int) -> str:
        return varied_text(self.words_for(n_tokens), seed)

    def estimate(self, text: str) -> int:
        return round(len(text.split()) * self.tokens_per_word)

    async def count(self, client, text: str) -> tuple[int, bool]:
        """(tokens, measured): the server's count when it has one, else the estimate."""
        if self.measured:
            n = await client.count_tokens(text)
            if n is not None:
                return n, True
        return self.estimate(text), False


def salted_prompt(sizer: TextSizer, n_tokens: int, seed: int, question: str) -> str:
    """A user message of about n_tokens that starts with a fresh salt and ends with a question."""
    return f"{fresh_salt()}\n\n{sizer.filler(n_tokens, seed)}\n\n{question}"
