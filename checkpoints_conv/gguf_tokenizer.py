"""Rebuild a Hugging Face fast tokenizer from the tokenizer metadata of a GGUF file.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary, merges, token types and special
token ids as metadata under `tokenizer.ggml.*`. This module turns that metadata back into a
`tokenizers.Tokenizer` (plus the few `tokenizer_config.json` fields the runtime needs) so that a
converted checkpoint directory tokenizes exactly like the model was trained, without transformers.

Supported `tokenizer.ggml.model` values:
    "gpt2"  byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2, ...); `tokenizer.ggml.pre` picks the split
            rules, following llama.cpp's pre-tokenizer table.
    "llama" SentencePiece BPE with byte fallback (Llama 2 style).

    reader = gguf.GGUFReader("model.gguf")
    tokenizer, config = tokenizer_from_gguf(reader)
    save_tokenizer(tokenizer, config, "out/")
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

if TYPE_CHECKING:
    import gguf

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama")

# Llama 3's split rule (tiktoken cl100k): numbers in groups of up to three digits.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as Llama 3 except that every digit stands alone.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` names grouped the way llama.cpp's llama-vocab.cpp groups them.
# ("default" really has its own rule in llama.cpp; the GPT-2 split is the closest tokenizers builds in.)
_PRE_GPT2 = {"gpt2", "gpt-2", "phi-2", "default", "mpt", "olmo", "jais"}
# llama.cpp first isolates every digit (`\p{N}`), then applies the GPT-2 rule to what is left.
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "smaug-bpe", "dbrx", "pixtral"}
_PRE_QWEN2 = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _PRE_DIGITS_THEN_GPT2:
        # The same construction SmolLM2's own tokenizer.json uses, so the digit convention the model was
        # trained with is kept (transformers' GGUF loader does not know "smollm" and skips the digit split).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in _PRE_LLAMA3 or pre in _PRE_QWEN2:
        split = _LLAMA3_SPLIT if pre in _PRE_LLAMA3 else _QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _PRE_GPT2 and pre is not None:
        warnings.warn(
            f"GGUF pre-tokenizer {pre!r} is not known to jeagle; falling back to the GPT-2 byte-level split, "
            "which may tokenize some text (numbers, whitespace, CJK) differently from the original model",
            stacklevel=3,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _clean_merges(raw: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges as pairs, dropping any the vocabulary cannot hold: tokenizers refuses to build a BPE
    model with a merge whose parts or result are not in the vocabulary."""
    merges, dropped = [], 0
    for line in raw:
        left, sep, right = line.partition(" ")
        if sep and left and right and left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
        else:
            dropped += 1
    if dropped:
        warnings.warn(f"dropped {dropped} GGUF merges that do not fit the vocabulary", stacklevel=3)
    return merges


def _template_processor(bos: str | None, eos: str | None, ids: dict[str, int]) -> processors.TemplateProcessing:
    bos_a = f"{bos}:0 " if bos else ""
    eos_a = f" {eos}:0" if eos else ""
    bos_b = f" {bos}:1" if bos else ""
    eos_b = f" {eos}:1" if eos else ""
    return processors.TemplateProcessing(
        single=f"{bos_a}$A:0{eos_a}",
        pair=f"{bos_a}$A:0{eos_a}{bos_b} $B:1{eos_b}",
        special_tokens=[(t, ids[t]) for t in dict.fromkeys(x for x in (bos, eos) if x)],
    )


def _vocab_with_added(tokens: list[str], types: list[int], spell) -> tuple[dict[str, int], list[AddedToken]]:
    """Vocabulary keyed by model spelling, plus the tokens that must be matched whole in raw text.

    Control, user-defined and unknown tokens are stored by llama.cpp in raw (decoded) form and keyed
    that way here, so each added token maps onto its own id instead of getting a fresh one past the
    end of the vocabulary.
    """
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    duplicates = 0
    for index, (token, kind) in enumerate(zip(tokens, types)):
        whole = kind in (CONTROL, USER_DEFINED, UNKNOWN)
        key = token if whole else spell(token)
        if key in vocab:
            duplicates += 1
            continue
        vocab[key] = index
        if whole:
            added.append(AddedToken(token, special=kind != USER_DEFINED, normalized=False))
    if duplicates:
        warnings.warn(f"{duplicates} GGUF tokens repeat an earlier token's text; they can be decoded but never produced",
                      stacklevel=3)
    return vocab, added


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())

    def spell(token: str) -> str:
        # Vocabularies written by llama.cpp's converter are already byte-level spelled; respell any that is not.
        if set(token) <= spelled:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab, added = _vocab_with_added(meta["tokens"], meta["types"], spell)
    merges = _clean_merges(meta["merges"] or [], vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(meta["pre"])
    tokenizer.decoder = decoders.ByteLevel()
    return _finish(tokenizer, meta, added, processors.ByteLevel(trim_offsets=False))


def _sentencepiece_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: SentencePiece merges the adjacent pair whose
    joined piece scores highest, so every split of a piece into two pieces becomes a merge ranked by
    the joined piece's score."""
    mergeable = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == NORMAL}
    ranked = []
    for piece, index in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[index], index, mergeable[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    tokens, types = meta["tokens"], meta["types"]
    vocab, added = _vocab_with_added(tokens, types, lambda t: t)
    if meta["merges"]:
        merges = _clean_merges(meta["merges"], vocab)
    else:
        scores = meta["scores"]
        if scores is None or len(scores) != len(tokens):
            raise ValueError("GGUF 'llama' tokenizer has neither tokenizer.ggml.merges nor one score per token")
        merges = _sentencepiece_merges(tokens, types, scores)
    unk = meta["unk_token"] if meta["unk_token"] in vocab else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk, fuse_unk=True,
                                     byte_fallback=True))
    # A normalizer rather than Metaspace(prepend_scheme="first"): like SentencePiece and llama.cpp, every
    # run of text between special tokens gets its own leading "▁".
    steps = [normalizers.Replace(" ", "▁")]
    if meta["add_space_prefix"]:
        steps.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta["add_space_prefix"]:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return _finish(tokenizer, meta, added, None)


def _finish(tokenizer: Tokenizer, meta: dict[str, Any], added: list[AddedToken],
            base_processor: processors.PostProcessor | None) -> Tokenizer:
    special = [t for t in added if t.special]
    plain = [t for t in added if not t.special]
    if special:
        tokenizer.add_special_tokens(special)
    if plain:
        tokenizer.add_tokens(plain)
    # The flags live in tokenizer_config.json too, but baking them into the post-processor makes
    # tokenizer.json correct on its own, as Hugging Face's Llama tokenizers are.
    bos = meta["bos_token"] if meta["add_bos_token"] else None
    eos = meta["eos_token"] if meta["add_eos_token"] else None
    steps = [base_processor] if base_processor is not None else []
    if bos or eos:
        ids = {t: tokenizer.token_to_id(t) for t in (bos, eos) if t}
        steps.append(_template_processor(bos, eos, ids))
    if len(steps) == 1:
        tokenizer.post_processor = steps[0]
    elif steps:
        tokenizer.post_processor = processors.Sequence(steps)
    return tokenizer


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def tokenizer_from_gguf(reader: "gguf.GGUFReader") -> tuple[Tokenizer, dict]:
    """Returns the fast tokenizer and a tokenizer_config dict with keys:
    bos_token, eos_token, pad_token, unk_token (strings or None), add_bos_token (bool), add_eos_token (bool),
    chat_template (str or None)."""
    model = _field(reader, "tokenizer.ggml.model")
    if model not in _BUILDERS:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; supported tokenizer.ggml.model values: "
            f"{', '.join(repr(m) for m in SUPPORTED_MODELS)}"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens; it carries no tokenizer")
    types = _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

    def token(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", model == "llama")
    config = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    meta = {
        **config,
        "tokens": tokens,
        "types": types,
        "merges": _field(reader, "tokenizer.ggml.merges"),
        "scores": _field(reader, "tokenizer.ggml.scores"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "add_space_prefix": bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
    }
    return _BUILDERS[model](meta), config


def save_tokenizer(tokenizer: Tokenizer, config: dict, out_dir: str | Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    file_config = {
        # Lets transformers open the directory too; the class exists in transformers 4.x and 5.x.
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Decoding must give back the exact text, not transformers' legacy " ." -> "." clean-up.
        "clean_up_tokenization_spaces": False,
        **config,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(file_config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
