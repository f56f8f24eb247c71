"""A small Qwen-style tokenizer folder for tiny test models and random-weight full-size models.

The files have the layout of a real Qwen checkpoint (tokenizer.json, tokenizer_config.json,
chat_template.jinja) and load in transformers' AutoTokenizer, which encodes exactly like we do.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The pipeline transformers' Qwen2Tokenizer rebuilds from vocab + merges: ours must be the same or
# AutoTokenizer would encode differently from the tokenizer.json we write.
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen's added tokens in id order, with their `special` flag. Tool-call, tool-response and think
# tags (and the FIM/repo tokens) are not special in Qwen, so they survive skip_special_tokens.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# The embedded corpus runs out of useful merges long before this; it only bounds training time.
MAX_BPE_VOCAB = 8192
MODEL_MAX_LENGTH = 262144

_HERE = Path(__file__).parent
TOOL_FORMATS = ("qwen3_coder", "hermes")


def write_tokenizer_files(
    out_dir, *, vocab_size: int, special_token_ids: dict[str, int] | None = None, tool_format: str = "qwen3_coder"
) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir.

    special_token_ids=None puts Qwen's 26 added tokens at the top of [0, vocab_size) and gives the
    byte-level BPE the rest. A dict such as {"<|endoftext|>": 248044} fixes where the block starts
    (tokens it does not name follow their predecessor); the BPE then fills ids from 0 as far as the
    corpus supports, and the ids in between are simply never produced. Returns name -> id.
    """
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    special_ids = _place_specials(vocab_size, special_token_ids)
    bpe_size = min(min(special_ids.values()), MAX_BPE_VOCAB)
    if bpe_size < 256 + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves {bpe_size} ids below the special tokens; need > 256")

    vocab, merges = _train_bpe(bpe_size)
    vocab.update(special_ids)
    _fill_unused_ids(vocab, vocab_size)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    )
    _set_qwen_pipeline(tok)
    # Added tokens that are already in the model vocab keep their ids, wherever they are.
    tok.add_tokens([AddedToken(name, special=special, normalized=False) for name, special in QWEN_ADDED_TOKENS])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(special_ids), indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text((_HERE / "templates" / f"{tool_format}.jinja").read_text())
    return special_ids


def _place_specials(vocab_size: int, given: dict[str, int] | None) -> dict[str, int]:
    names = [name for name, _ in QWEN_ADDED_TOKENS]
    given = dict(given or {names[0]: vocab_size - len(names)})
    unknown = set(given) - set(names)
    if unknown:
        raise ValueError(f"unknown special tokens {sorted(unknown)}; known: {names}")
    if names[0] not in given:
        raise ValueError(f"special_token_ids must place {names[0]!r}, the first of the block")
    ids: dict[str, int] = {}
    previous = None
    for name in names:
        ids[name] = previous = given[name] if name in given else previous + 1
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"special token ids collide: {ids}")
    bad = {name: i for name, i in ids.items() if not 0 <= i < vocab_size}
    if bad:
        raise ValueError(f"special token ids {bad} are outside [0, vocab_size={vocab_size})")
    return ids


def _set_qwen_pipeline(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)


def _fill_unused_ids(vocab: dict[str, int], vocab_size: int) -> None:
    """Give every id below vocab_size a visible string (two BPE pieces glued together).

    A random-weight model samples ids uniformly over the model's vocabulary; a full-size vocab (248K) is
    far larger than the BPE we train, and ids without a string would decode to nothing, so benchmarks of
    streamed text would see no deltas. No merge produces these entries, so encoding is unchanged.
    """
    used = set(vocab.values())
    pieces = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if len(t) > 1 and not t.startswith("<|")]
    taken = set(vocab)
    n = len(pieces)
    j = 0                          # the j-th glued pair: (j mod n, j div n) are all distinct
    for i in range(vocab_size):
        if i in used:
            continue
        while (candidate := pieces[j % n] + pieces[(j // n) % n]) in taken:
            j += 1
        j += 1
        vocab[candidate] = i
        taken.add(candidate)


def _train_bpe(bpe_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    tok = Tokenizer(models.BPE())
    _set_qwen_pipeline(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size, min_frequency=0, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = (_HERE / "synthetic_corpus.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def _tokenizer_config(special_ids: dict[str, int]) -> dict:
    specials = dict(QWEN_ADDED_TOKENS)
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": specials[name]}
            for name, i in special_ids.items()
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
