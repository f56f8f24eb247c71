"""The model's tokenizer: HF `tokenizers` for text <-> ids, plus its chat template and stop ids."""

import json
from pathlib import Path

import tokenizers

from flashnext.tokenizer.chat_template import ChatTemplateError, render_chat
from flashnext.tokenizer.piece_cache import PieceCache


class InvalidText(ValueError):
    """Text that is not valid Unicode (a lone surrogate, which JSON's \\u escapes can carry): it has no UTF-8."""


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        generation_eos_ids: tuple[int, ...] = (),
    ):
        self._backend = backend
        self._pieces = PieceCache(backend)
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        vocab = backend.get_vocab(with_added_tokens=True)
        # The id space the tokenizer can produce; a model's embedding may have more (padded) rows.
        self.vocab_size = max(vocab.values()) + 1
        self.eos_token_id = self._require_id(eos_token, "eos_token") if eos_token else None
        self.pad_token_id = self._require_id(pad_token, "pad_token") if pad_token else None
        eos = set(generation_eos_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja (or the template inside
        tokenizer_config.json) and the eos ids of generation_config.json from a model folder."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only HF fast-tokenizer folders are supported)")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        template_file = path / "chat_template.jinja"
        chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        if chat_template is None:
            chat_template = _pick_template(config.get("chat_template"))
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        gen_eos = () if gen_eos is None else (gen_eos,) if isinstance(gen_eos, int) else tuple(gen_eos)
        return cls(
            backend,
            chat_template=chat_template,
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            generation_eos_ids=gen_eos,
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidText(f"the text holds a lone surrogate (\\u{ord(text[e.start]):04x} at character "
                                  f"{e.start}): not valid Unicode") from None
        if not add_special_tokens:   # a prompt: its pieces seen before are not encoded again (piece_cache.py)
            return self._pieces.encode(text)
        return self._backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def tool_format(self) -> str:
        """The tool-call syntax the template teaches: "qwen3_coder" (XML, <function=NAME>) or "hermes" (JSON)."""
        return "qwen3_coder" if self.chat_template and "<function=" in self.chat_template else "hermes"

    def apply_chat_template(self, messages, /, tools=None, add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions endpoint")
        return render_chat(self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           **kwargs)

    def _require_id(self, token: str, what: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json {what} {token!r} is not in the vocabulary")
        return token_id


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token) -> str | None:
    # tokenizer_config.json writes a token either as its string or as a serialised AddedToken.
    return token.get("content") if isinstance(token, dict) else token


def _pick_template(template) -> str | None:
    # Older configs store a list of named templates; "default" is the chat one.
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template
