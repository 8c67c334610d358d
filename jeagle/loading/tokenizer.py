"""The runtime tokenizer: text <-> token ids, chat templates and streaming detokenization.

Built on the `tokenizers` library and jinja2 only, so serving never imports transformers or torch.
`Tokenizer.from_dir` opens jeagle's converted checkpoint directories and plain Hugging Face model
directories alike, and follows transformers' semantics where they matter for matching its outputs:
special tokens named in tokenizer_config.json match whole, BOS is added per `add_bos_token` unless
the tokenizer.json post-processor already adds it, and chat templates render in a sandboxed jinja2
environment with the same options, filters and globals.

    tok = Tokenizer.from_dir("checkpoint/")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    stream = StreamDecoder(tok)
    for token_id in generated:
        print(stream.push(token_id), end="")
    print(stream.flush())
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from tokenizers import AddedToken

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's table), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _has_decoder(node: Any, kind: str) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence of them) includes `kind`."""
    if not isinstance(node, dict):
        return False
    return node.get("type") == kind or any(_has_decoder(d, kind) for d in node.get("decoders") or ())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _optional_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    # Older Hugging Face configs hold a list of named templates; "default" is the one chat uses.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _extra_special_tokens(config: dict) -> list[str | None]:
    # transformers 4.x calls them additional_special_tokens (a list), 5.x extra_special_tokens
    # (a list or a name -> token dict).
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        extra = list(extra.values())
    return [_token_text(t) for t in extra] if isinstance(extra, list) else []


class Tokenizer:
    """A fast tokenizer plus the checkpoint's special-token and chat-template settings."""

    def __init__(self, fast: tokenizers.Tokenizer, config: dict | None = None,
                 generation_config: dict | None = None, chat_template: str | None = None):
        config = dict(config or {})
        generation_config = generation_config or {}
        self._fast = fast
        self.special_tokens = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        self._mark_special([*self.special_tokens.values(), *_extra_special_tokens(config)])
        self.chat_template = chat_template if chat_template is not None else _pick_template(config.get("chat_template"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self._byte_level: bool | None = None  # a byte-level BPE decoder (token_bytes), found on first use
        self._pieces: dict[int, tuple[bytes, str, list[int]]] = {}  # `token_piece`'s cache

        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        if self.bos_token_id is None and self.special_tokens["bos_token"] is None:
            self.bos_token_id = next(iter(_as_ids(generation_config.get("bos_token_id"))), None)
        eos = [self._id_of(self.special_tokens["eos_token"])] + _as_ids(generation_config.get("eos_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        self.pad_token_id = self._id_of(self.special_tokens["pad_token"])

        # Probe what the tokenizer.json post-processor does, so BOS/EOS are never added twice
        # (Hugging Face Llama dirs set add_bos_token *and* bake BOS into the post-processor).
        probe_plain = fast.encode("a", add_special_tokens=False).ids
        probe_full = fast.encode("a", add_special_tokens=True).ids
        bos, eos_id = self.bos_token_id, (self.eos_token_ids[0] if self.eos_token_ids else None)
        self._post_adds_bos = bos is not None and probe_full[:1] == [bos] and probe_plain[:1] != [bos]
        self._post_adds_eos = eos_id is not None and probe_full[-1:] == [eos_id] and probe_plain[-1:] != [eos_id]

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Open a directory holding tokenizer.json (+ optional tokenizer_config.json,
        generation_config.json, special_tokens_map.json, chat_template.jinja)."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tokenizer_file}")
        try:
            text = tokenizer_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{tokenizer_file} is not valid JSON: {e}") from None
        try:
            fast = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception on a malformed model
            try:  # Python's JSON error names the place; parsed only on failure (a few MB: 20-50 ms)
                json.loads(text)
            except json.JSONDecodeError as je:
                raise ValueError(f"{tokenizer_file} is not valid JSON: {je}") from None
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer.json: {e}") from None

        config = _optional_json(root / "tokenizer_config.json")
        special_map = _optional_json(root / "special_tokens_map.json")
        for name in _SPECIAL_NAMES:
            if _token_text(config.get(name)) is None and _token_text(special_map.get(name)) is not None:
                config[name] = special_map[name]
        _add_declared_tokens(fast, config.get("added_tokens_decoder"), root / "tokenizer_config.json")

        # Recent transformers versions save the template beside the config; the separate file wins, as there.
        chat_template = None
        if (root / "chat_template.jinja").is_file():
            chat_template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        elif (root / "chat_template.json").is_file():
            chat_template = _pick_template(_optional_json(root / "chat_template.json").get("chat_template"))
        return cls(fast, config, _optional_json(root / "generation_config.json"), chat_template)

    def _id_of(self, token: str | None) -> int | None:
        return self._fast.token_to_id(token) if token is not None else None

    def _mark_special(self, names: Iterable[str | None]) -> None:
        # transformers registers every named special token as a special added token: it then matches
        # whole in text and is dropped by skip_special_tokens, even when tokenizer.json lists it as a
        # plain vocabulary entry.
        present = [t for t in dict.fromkeys(names) if t is not None and self._fast.token_to_id(t) is not None]
        if present:
            self._fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in present])

    @property
    def vocab_size(self) -> int:
        return self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._fast

    def token_to_id(self, token: str) -> int | None:
        return self._fast.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._fast.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and not self._post_adds_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and not self._post_adds_eos and self.eos_token_ids:
                ids = [*ids, self.eos_token_ids[0]]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI logprobs' `bytes`): a byte-level BPE token's bytes, a
        byte-fallback token's one byte (`<0xE2>`), else the token's text with SentencePiece's `▁` as a
        space. A token may be part of a UTF-8 character: its bytes need not decode alone."""
        return self.token_piece(token_id)[0]

    def token_piece(self, token_id: int) -> tuple[bytes, str, list[int]]:
        """(`token_bytes`, `token_text`, the bytes as a list of ints) of one token, cached: a streamed
        response with `top_logprobs` asks for six tokens' pieces per token it emits."""
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._token_bytes(token_id)
            piece = self._pieces[int(token_id)] = (raw, raw.decode("utf-8", errors="replace"), list(raw))
        return piece

    def _token_bytes(self, token_id: int) -> bytes:
        tok = self._fast.id_to_token(int(token_id))
        if tok is None:
            return b""
        if self._byte_level is None:
            self._byte_level = _has_decoder(json.loads(self._fast.to_str()).get("decoder"), "ByteLevel")
        if self._byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in tok):
                return bytes(table[c] for c in tok)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tok)
        if m:
            return bytes([int(m.group(1), 16)])
        return tok.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """One token's text (invalid UTF-8 of a partial character shown as U+FFFD)."""
        return self.token_piece(token_id)[1]

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any) -> str:
        """Render `messages` with the checkpoint's chat template; extra keywords (tools, documents,
        enable_thinking, ...) are passed to the template as variables."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (none in tokenizer_config.json or chat_template.jinja)")
        variables = {name: text for name, text in self.special_tokens.items() if text is not None}
        variables.update({"tools": None, "documents": None})
        variables.update(template_vars)
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any) -> list[int]:
        # Templates write their own BOS where the model wants one, so, like transformers, encode the
        # rendered text without adding special tokens.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **template_vars),
                           add_special_tokens=False)


def _add_declared_tokens(fast: tokenizers.Tokenizer, declared: Any, source: Path) -> None:
    """Add the tokens tokenizer_config.json's added_tokens_decoder lists but tokenizer.json lacks."""
    if not isinstance(declared, dict):
        return
    entries = []
    for key, spec in declared.items():
        content = _token_text(spec)
        if content is None or not str(key).isdigit():
            raise ValueError(f"{source}: malformed added_tokens_decoder entry {key!r}")
        entries.append((int(key), content, spec if isinstance(spec, dict) else {}))
    for token_id, content, spec in sorted(entries):
        if fast.token_to_id(content) is not None:
            continue
        special = bool(spec.get("special", False))
        token = AddedToken(content, single_word=bool(spec.get("single_word", False)),
                           lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                           normalized=bool(spec.get("normalized", not special)), special=special)
        (fast.add_special_tokens if special else fast.add_tokens)([token])
        if fast.token_to_id(content) != token_id:
            raise ValueError(f"{source}: added token {content!r} is declared as id {token_id} but would get id "
                             f"{fast.token_to_id(content)}; tokenizer.json and tokenizer_config.json disagree")


@lru_cache(maxsize=8)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Chat templates are untrusted code from model repositories; older jinja2 sandboxes can be escaped.
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6 (found {jinja2.__version__}): pip install -U jinja2")

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        transformers; for rendering it is transparent."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes "<", ">", "&" and "'"; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class StreamDecoder:
    """Incremental detokenization for streaming output.

    Decoding one token at a time is wrong for two reasons: a byte-level token can hold part of a
    UTF-8 character (an emoji spans up to four tokens), and SentencePiece decoders drop the leading
    space of the first token they see. So each step decodes a short window of recent tokens with
    and without the new ones and emits the difference, holding it back while it ends in an
    incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_start = 0  # start of the already-emitted tokens kept as decoding context
        self._emitted_end = 0  # tokens before this index have been emitted

    def _pending(self) -> str:
        prefix = self._tokenizer.decode(self._ids[self._prefix_start:self._emitted_end], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix_start:], self._skip)
        return text[len(prefix):] if len(text) > len(prefix) else ""

    def _advance(self) -> None:
        self._prefix_start, self._emitted_end = self._emitted_end, len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        new = self._pending()
        if not new or new.endswith("\ufffd"):
            return ""
        self._advance()
        return new

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        new = self._pending()
        self._advance()
        return new
