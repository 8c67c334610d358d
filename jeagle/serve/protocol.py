"""The OpenAI wire format: a request body → checked options, prompt ids and `SamplingParams`; results
→ response bodies, stream chunks and error bodies; stop strings matched on the decoded text.

Everything here is plain data in, plain data out (no HTTP, no engine): a bad request raises
`BadRequest`, which the app turns into an OpenAI-style error body with its status. Bodies are encoded
with orjson; chat logprobs come pre-encoded (`TokenJSON`, `chat_logprobs_packed`).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time

import orjson

from jeagle.sampling.logprobs import LOGPROB_TOP, to_bytes
from jeagle.sampling.penalties import MAX_LOGIT_BIAS
from jeagle.sampling import SamplingParams

MAX_STOP_STRINGS = 4

MAX_N = 16  # completions per request (`n`)

INT32_MAX = 2**31 - 1  # fields the device reads as int32: a larger value failed the whole batch's step

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's (its deprecated "function" role: no)

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "n",
          "user", "ignore_eos", "logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens",
          "logit_bias", "response_format", "regex", "ebnf"}
COMPLETION_KEYS = COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                      "parallel_tool_calls"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- requests in --------------------------------------------------------------------------------------
def _number(body, key, lo=None, hi=None, integer=False, default=None, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", key)
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """The top count of the request's logprobs, None if it asks for none. Chat: `logprobs: true`
    with `top_logprobs: k`; completions: `logprobs: k`. k in [0, LOGPROB_TOP]."""
    if chat:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise BadRequest(f"'logprobs' must be a boolean, got {on!r}", "logprobs")
        top = _number(body, "top_logprobs", 0, LOGPROB_TOP, integer=True)
        if top is not None and not on:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    return _number(body, "logprobs", 0, LOGPROB_TOP, integer=True)


def parse_common(body: dict, allowed: set[str]) -> dict:
    """The options both endpoints share, checked: max_tokens, temperature, top_p, top_k, seed, stop,
    stream, ignore_eos, n, logprobs (and echo for completions); unknown keys and unsupported features
    are a BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown parameter '{unknown[0]}'", unknown[0])
    chat = "messages" in allowed
    n = _number(body, "n", 1, MAX_N, integer=True, default=1)
    logprobs = _logprobs(body, chat)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be a boolean", "echo")
    if body.get("suffix") is not None:
        raise BadRequest("suffix is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequest("best_of other than n is not supported", "best_of")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop) or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be a boolean", "ignore_eos")
    options = body.get("stream_options")
    if options is not None:  # OpenAI's: only {"include_usage": bool}, only with streaming
        if not stream:
            raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if (not isinstance(options, dict) or set(options) - {"include_usage"}
                or not isinstance(options.get("include_usage", False), bool)):
            raise BadRequest("'stream_options' must be an object {\"include_usage\": boolean}", "stream_options")
    return {
        "max_tokens": _number(body, "max_completion_tokens", 1, integer=True) or _number(body, "max_tokens", 1,
                                                                                           integer=True),
        "temperature": _number(body, "temperature", 0.0, 2.0, default=1.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True),
        "top_k": _number(body, "top_k", -1, INT32_MAX, integer=True, default=0),
        "seed": _number(body, "seed", 0, 2**32 - 1, integer=True),
        "stop": stop, "stream": stream, "ignore_eos": ignore_eos, "n": n, "logprobs": logprobs, "echo": echo,
        "include_usage": bool((options or {}).get("include_usage", False)),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0, default=0.0),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0, default=0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, 10.0, default=1.0, lo_open=True),
        "min_tokens": _number(body, "min_tokens", 0, INT32_MAX, integer=True, default=0),
        "logit_bias": _logit_bias(body),
    }


def grammar_request(body: dict) -> tuple[str, object] | None:
    """The structured output a request asks for, as (kind, source) for `GrammarBackend.compile`, or
    None: `response_format` {"type": "json_object"} / {"type": "json_schema", "json_schema": {"schema":
    ...}} / {"type": "text"}, or SGLang's `regex` / `ebnf` string; at most one of them."""
    asked = [k for k in ("response_format", "regex", "ebnf") if body.get(k) is not None]
    if len(asked) > 1:
        raise BadRequest(f"give at most one of response_format, regex, ebnf (got {', '.join(asked)})", asked[1])
    if not asked:
        return None
    key = asked[0]
    value = body[key]
    if key in ("regex", "ebnf"):
        if not isinstance(value, str) or not value:
            raise BadRequest(f"'{key}' must be a non-empty string", key)
        return key, value
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                         "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return "json_object", None
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return "json_schema", schema


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {token id (a string or an integer): bias in [-100, 100]}."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise BadRequest("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' has {len(raw)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = {}
    for k, v in raw.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest(f"'logit_bias' for token {k} must be a number in [-100, 100], got {v!r}", "logit_bias")
        if tok in out:
            raise BadRequest(f"'logit_bias' names token {tok} twice", "logit_bias")
        out[tok] = float(v)
    return tuple(out.items())


DEFAULT_MODEL = "default"  # the name SGLang's server answers to whatever it serves; its clients and docs send it


def check_model(body: dict, model_name: str, aliases: tuple[str, ...] = ()) -> None:
    """A request's `model` must be absent, `default`, the served name, or one of its aliases (the
    target's path as given on the command line)."""
    if body.get("model") not in (None, DEFAULT_MODEL, model_name, *aliases):
        raise BadRequest(f"model '{body.get('model')}' is not served here (this server: '{model_name}')", "model",
                         kind="invalid_request_error")


def completion_prompt_ids(body: dict, tokenizer) -> list[int]:
    """/v1/completions' `prompt`: a string, a one-string list, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)", "prompt")
    if not ids:
        raise BadRequest("'prompt' is empty", "prompt")
    return ids


def chat_prompt_ids(body: dict, tokenizer, tools: list | None = None) -> list[int]:
    """/v1/chat/completions' `messages` through the tokenizer's chat template; `tools` (checked,
    `jeagle.serve.tools`), when given, passed to it as Hugging Face's `apply_chat_template` does."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    # A template renders any role it is given, so an unknown one would reach the model as text of its own.
    bad = [m.get("role") for m in messages if m.get("role") not in CHAT_ROLES]
    if bad:
        raise BadRequest(f"message role {bad[0]!r} is not one of {', '.join(CHAT_ROLES)}", "messages")
    rendered = [template_message(i, m) for i, m in enumerate(messages)]
    if not tokenizer.has_chat_template:
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.encode_chat(rendered, **({} if tools is None else {"tools": tools}))
    except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
        raise BadRequest(f"chat template: {e}", "messages") from e


def template_message(i: int, m: dict) -> dict:
    """Message `i` as chat templates read it: {role, content} with string content; an assistant's
    `tool_calls` (content may then be null or absent: ""), their arguments as a mapping (Llama 3.x's and
    Qwen2.5's templates write `arguments | tojson`, so a JSON string would reach the model quoted); a
    tool result's `tool_call_id` (and `name`)."""
    where, calls = f"messages[{i}]", m.get("tool_calls")
    content = m.get("content")
    if content is None and m["role"] == "assistant" and calls:
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"'{where}.content' must be a string"
                         + (" (or null beside tool_calls)" if m["role"] == "assistant" else ""), "messages")
    out = {"role": m["role"], "content": content}
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"'{where}.tool_call_id' must be a string: the id of the call this answers", "messages")
        out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    if calls is None:
        return out
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise BadRequest(f"'{where}.tool_calls' must be a list, on an assistant message", "messages")
    out["tool_calls"] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"'{where}.tool_calls[{j}]' must be {{\"type\": \"function\", \"function\": "
                             "{\"name\", \"arguments\"}}", "messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = None
        if not isinstance(args, dict):
            raise BadRequest(f"'{where}.tool_calls[{j}].function.arguments' must be a JSON object or a string "
                             "holding one", "messages")
        out["tool_calls"].append({"id": call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{j}",
                                  "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def sampling_params(opts: dict, n_prompt: int, chat: bool, max_context: int, reserve: int,
                    default_max_tokens: int = 16) -> SamplingParams:
    """The request's SamplingParams; max_tokens checked against the room the context leaves (`reserve`
    positions kept free for speculation) and defaulted as OpenAI does (chat: the room; completions:
    `default_max_tokens`, OpenAI's 16, within the room)."""
    room = max_context - n_prompt - reserve
    if room < 1:
        raise BadRequest(f"the prompt has {n_prompt} tokens; the context holds {max_context} "
                         f"(with {reserve} reserved for speculation): no room for new tokens", "messages" if chat
                         else "prompt", kind="invalid_request_error")
    max_tokens = opts["max_tokens"]
    if max_tokens is None:
        max_tokens = room if chat else min(default_max_tokens, room)
    elif max_tokens > room:
        raise BadRequest(f"max_tokens {max_tokens} + the prompt's {n_prompt} tokens exceed the context of "
                         f"{max_context} ({reserve} reserved for speculation): at most {room}", "max_tokens")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=float(opts["temperature"]),
                              top_k=max(0, opts["top_k"]), top_p=float(opts["top_p"]), seed=opts["seed"],
                              ignore_eos=opts["ignore_eos"], logprobs=opts["logprobs"],
                              prompt_logprobs=opts["echo"] and opts["logprobs"] is not None,
                              frequency_penalty=float(opts["frequency_penalty"]),
                              presence_penalty=float(opts["presence_penalty"]),
                              repetition_penalty=float(opts["repetition_penalty"]), min_tokens=opts["min_tokens"],
                              logit_bias=opts["logit_bias"])
    except ValueError as e:
        raise BadRequest(str(e)) from e


def request_params(body: dict, opts: dict, n_prompt: int, chat: bool, facts, grammar,
                   default_max_tokens: int = 16) -> SamplingParams:
    """A checked body's SamplingParams with its grammar: `sampling_params` on `parse_common`'s `opts`,
    the structured output `grammar_request` finds compiled by `grammar(kind, source)`, the logit bias's
    token ids checked against the vocabulary. facts: the engine's (`EngineFacts`)."""
    params = sampling_params(opts, n_prompt, chat, facts.max_context, facts.context_reserve, default_max_tokens)
    asked = grammar_request(body)
    if asked is not None:
        params = dataclasses.replace(params, grammar=grammar(*asked))
    bad = [t for t, _ in params.logit_bias if not 0 <= t < facts.vocab_size]
    if bad:
        raise BadRequest(f"'logit_bias' names token ids outside the vocabulary: {bad[:5]}", "logit_bias")
    return params


def seeded(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of `n` samples of one prompt: each its own seed stream (seed + i when one is given)."""
    return [params if i == 0 or params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**32)
            for i in range(n)]


# ---- results out --------------------------------------------------------------------------------------
class StopMatcher:
    """Text → (text safe to emit, stopped). Holds back a tail that may be the start of a stop string;
    `matched`: the stop string that ended the text."""

    def __init__(self, stops: list[str]):
        self.stops, self.buffer, self.stopped, self.matched = stops, "", False, None

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buffer += text
        hits = [(self.buffer.find(s), s) for s in self.stops if s in self.buffer]
        if hits:
            cut, self.matched = min(hits)
            out, self.buffer, self.stopped = self.buffer[:cut], "", True
            return out
        # The longest tail of the buffer that starts a stop string: tails no longer than the buffer, so a
        # long stop string costs what the text does (slicing every prefix of it took seconds a token).
        n = len(self.buffer)
        hold = max((next((k for k in range(min(len(s) - 1, n), 0, -1) if s.startswith(self.buffer[n - k:])), 0)
                    for s in self.stops), default=0)
        out, self.buffer = self.buffer[: len(self.buffer) - hold], self.buffer[len(self.buffer) - hold:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


def stream_chunk(rid: str, model_name: str, chat: bool, text: str, finish: str | None, first: bool = False,
                 index: int = 0, logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
    """One server-sent event's object for choice `index` (chat: the first carries the assistant role;
    `tool_calls`: the delta's calls, each with its `index`)."""
    if chat:
        delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice]}


def usage_chunk(rid: str, model_name: str, chat: bool, usage: dict) -> dict:
    """The last event of a stream asked with `stream_options.include_usage`: no choices, the usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [], "usage": usage}


def usage_body(n_prompt: int, n_completion: int, cached: int = 0) -> dict:
    """OpenAI's usage; `cached`: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_body(chat: bool, index: int, text: str, finish: str | None, logprobs: dict | None = None,
                tool_calls: list | None = None) -> dict:
    """One choice of a whole response (chat with `tool_calls`: its content null when empty, as OpenAI's)."""
    if chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_body(rid: str, model_name: str, chat: bool, choices: list[dict], n_prompt: int,
                    n_completion: int, cached: int = 0) -> dict:
    """A whole (not streamed) response: its choices (`choice_body`) and usage (the prompt counted once)."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": usage_body(n_prompt, n_completion, cached)}


# ---- logprobs out ---------------------------------------------------------------------------------------
class _Templates(dict):
    """token id → bytes, made on first use by `make(token id)`."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, token_id):
        value = self[token_id] = self.make(token_id)
        return value


class TokenJSON:
    """One tokenizer's tokens as pre-encoded JSON pieces of a chat `logprobs` entry, made once per token
    id: (`{"token":TEXT,"logprob":`, `,"bytes":[...]`), and joined around a `%s` for the number (`%`
    escaped): `heads[id]` (an entry whose `top_logprobs` follow) and `tops[id]` (a closed entry). A
    streamed `top_logprobs: 5` response writes six entries per token it emits; filling cached templates
    costs a fraction of building and encoding six dicts, and this host time is taken from the engine
    thread's GIL (bench/HISTORY.md, 2026-11-25)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, tuple[bytes, bytes]] = {}
        self.heads = _Templates(lambda t: self._template(t))
        self.tops = _Templates(lambda t: self._template(t) + b"}")

    def __call__(self, token_id: int) -> tuple[bytes, bytes]:
        piece = self._pieces.get(token_id)
        if piece is None:
            _, text, raw = self.tokenizer.token_piece(token_id)
            piece = self._pieces[token_id] = (b'{"token":' + orjson.dumps(text) + b',"logprob":',
                                              b',"bytes":' + orjson.dumps(raw))
        return piece

    def _template(self, token_id: int) -> bytes:
        head, tail = self(token_id)
        return head.replace(b"%", b"%%") + b"%s" + tail.replace(b"%", b"%%")


_LAYOUTS: dict[int, tuple[struct.Struct, struct.Struct]] = {}


def _layout(k: int) -> tuple[struct.Struct, struct.Struct]:
    """Structs reading a packed block (`jeagle.sampling.logprobs`) for top k: its floats (the logprob, the top
    k logprobs) and its top k ids."""
    got = _LAYOUTS.get(k)
    if got is None:
        rest = 4 * (LOGPROB_TOP - k)
        got = _LAYOUTS[k] = (struct.Struct(f"=f{4 * LOGPROB_TOP}x{k}f{rest}x"),
                             struct.Struct(f"=4x{k}i{rest + 4 * LOGPROB_TOP}x"))
    return got


def chat_logprobs_packed(pieces: TokenJSON, ids: list[int], packed: bytes, k: int) -> orjson.Fragment:
    """Chat's `logprobs` object for tokens `ids` and their packed logprob blocks (`logprobs.to_bytes`),
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]},
    ...], "refusal": null}, as JSON ready to splice into a chunk or body (`orjson.dumps` copies a
    Fragment as it is). Per piece, not per token: `struct` reads every number, one `orjson.dumps`
    encodes them all (the same text as one at a time: shortest round trip of the float32 widened to a
    double, non-finite as null), and one `%` fills them into the tokens' cached templates."""
    if not ids:
        return orjson.Fragment(b'{"content":[],"refusal":null}')
    floats, top_ids = _layout(k)
    nums = orjson.dumps(list(floats.iter_unpack(packed)))[2:-2].replace(b"],[", b",").split(b",")
    heads, tops = pieces.heads, pieces.tops
    entries = [heads[t] + b',"top_logprobs":[' + b",".join(map(tops.__getitem__, top)) + b"]}"
               for t, top in zip(ids, top_ids.iter_unpack(packed))]
    return orjson.Fragment(b'{"content":[' + b",".join(entries) % tuple(nums) + b'],"refusal":null}')


def chat_logprobs(pieces: TokenJSON, pairs, k: int) -> orjson.Fragment:
    """`chat_logprobs_packed` for (token id, TokenLogprob) pairs."""
    return chat_logprobs_packed(pieces, [t for t, _ in pairs], to_bytes([lp for _, lp in pairs]), k)


def completion_logprobs(tokenizer, pairs, k: int, offset: int = 0) -> dict:
    """Completions' legacy `logprobs` object for (token id, TokenLogprob or None) pairs (None: the
    first prompt token under echo, which has no logprob); text offsets count from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp in pairs:
        text = tokenizer.token_text(tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else {tokenizer.token_text(i): p for i, p in lp.top(k)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out
