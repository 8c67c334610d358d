"""SGLang's native `POST /generate`: its request → jeagle's prompts and SamplingParams, and each engine
request's pieces of text → SGLang's answers and stream events. Plain data in, plain data out, as
protocol.py; the route's handler is `app.generate`.

The names follow SGLang's own definitions: the request's fields its `GenerateReqInput`
(python/sglang/srt/managers/io_struct.py), `sampling_params` its `SamplingParams`
(python/sglang/srt/sampling/sampling_params.py), the answer what its tokenizer manager writes
(`{"text", "output_ids", "meta_info"}`, the finish reasons' `to_json` in managers/schedule_batch.py,
logprob entries `[logprob, token id, text or null]`). The sampling fields are checked by the OpenAI
endpoints' own code: renamed to OpenAI's (`max_new_tokens` → `max_tokens`, ...) and passed through
`protocol.parse_common` and `protocol.request_params`, so both APIs take the same values to the same
SamplingParams; their errors name SGLang's fields. A field jeagle would not act on is a 400 naming it
rather than silently ignored, except at SGLang's default value (its own frontend sends `min_p: 0.0`
with every request).

Where jeagle differs: `max_new_tokens` beyond the context's room is a 400 (SGLang trims it), as the
OpenAI endpoints answer; `logprob_start_len` -1 (the default) asks for the output tokens' logprobs only
and `input_token_logprobs` is then empty; a stream's events carry the whole text, `output_ids` and
logprobs so far, as SGLang's do by default, and a batch's events say their request by `index`.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass

import orjson

from jeagle.sampling import logprobs
from jeagle.sampling import SamplingParams
from jeagle.serve.protocol import COMPLETION_KEYS, BadRequest, parse_common, request_params, seeded

TOP_KEYS = frozenset({"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
                      "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"})

# SGLang's sampling field → the OpenAI body's field with the same meaning (parse_common's checks).
OPENAI_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
               "json_schema": "response_format"} | {k: k for k in (
                   "temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "stop", "ignore_eos", "n", "regex", "ebnf", "logit_bias")}
SGLANG_NAME = {v: k for k, v in OPENAI_NAME.items()}

# Fields jeagle does not act on, taken only at SGLang's default (what the request then asks is what it gets).
NEUTRAL = {"min_p": 0.0, "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
MAX_REQUESTS = 64  # engine requests per call: prompts × n
MAX_STOP_TOKEN_IDS = 64


@dataclass
class One:
    """One prompt of the call, checked."""
    ids: list[int]
    samples: list[SamplingParams]  # n of them, each its own seed stream
    stops: list[str]
    rid: str
    logprobs: int | None  # top_logprobs_num when return_logprob, else None
    start: int  # logprob_start_len: the first prompt position with logprobs, -1 none
    text_in_logprobs: bool


@dataclass
class Generate:
    items: list[One]
    batch: bool  # the answer is a list: a batch of prompts, or n > 1
    stream: bool
    field: str  # "text" or "input_ids": what a prompt's errors name


def parse(body, tokenizer, facts, grammar) -> Generate:
    """A /generate body → the checked call (a BadRequest names the field). facts: the engine's
    (`EngineFacts`); grammar(kind, source): the compiled grammar (`Served.grammar`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - TOP_KEYS)
    if unknown:
        raise BadRequest(f"'{unknown[0]}' is not supported by this server's /generate", unknown[0])
    given = [k for k in ("text", "input_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise BadRequest("give exactly one of 'text' and 'input_ids'", given[1] if given else "text")
    field = given[0]
    prompts, batch = _prompts(body[field], field)
    stream = _flag(body, "stream", False)
    n = len(prompts)
    if n > MAX_REQUESTS:  # before any prompt is tokenized
        raise BadRequest(f"at most {MAX_REQUESTS} prompts a call, got {n}", field)
    sps, rids = _each(body, "sampling_params", n, batch, dict), _each(body, "rid", n, batch, str)
    on, start = _each(body, "return_logprob", n, batch, bool), _each(body, "logprob_start_len", n, batch, int)
    tops, text_in = _each(body, "top_logprobs_num", n, batch, int), _flag(body, "return_text_in_logprobs", False)
    items = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt) if field == "text" else prompt
        if not ids:
            raise BadRequest(f"prompt {i} is empty", field)
        rid = rids[i] or uuid.uuid4().hex
        if batch and isinstance(body.get("rid"), str):  # one string for a batch: the prefix of its ids, as SGLang's
            rid = f"{rid}-{i}"
        items.append(_one(ids, sps[i] or {}, rid, bool(on[i]), start[i], tops[i], text_in, field, facts, grammar))
    if sum(len(one.samples) for one in items) > MAX_REQUESTS:
        raise BadRequest(f"at most {MAX_REQUESTS} generations a call (prompts × n)", "sampling_params.n")
    return Generate(items, batch or len(items[0].samples) > 1, stream, field)


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean", key)
    return value


def _prompts(value, field: str) -> tuple[list, bool]:
    """(the prompts, whether the call is a batch): a string or a list of them; token ids or lists of them."""
    def ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if field == "text":
        if isinstance(value, str):
            return [value], False
        if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            return value, True
        raise BadRequest("'text' must be a string or a non-empty list of strings", field)
    if ids(value) and value:
        return [value], False
    if isinstance(value, list) and value and all(ids(x) for x in value):
        return value, True
    raise BadRequest("'input_ids' must be a list of token ids or a non-empty list of such lists", field)


def _each(body: dict, key: str, n: int, batch: bool, kind: type) -> list:
    """A per-prompt field: one value for every prompt, or (a batch) a list of one per prompt; None: absent."""
    value = body.get(key)
    if isinstance(value, list) and batch:
        if len(value) != n:
            raise BadRequest(f"'{key}' has {len(value)} entries for {n} prompts", key)
        values = value
    else:
        values = [value] * n
    for v in values:
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise BadRequest(f"'{key}' must be {_KINDS[kind]}{' or a list of them, one per prompt' if batch else ''}",
                             key)
    return values


_KINDS = {dict: "an object", str: "a string", bool: "a boolean", int: "an integer"}


def _one(ids, sp: dict, rid: str, on: bool, start, top, text_in: bool, field: str, facts, grammar) -> One:
    """One prompt's request: its SGLang sampling fields as an OpenAI completions body, checked by the
    OpenAI path's own functions, then SGLang's extras (stop_token_ids)."""
    body: dict = {}
    stop_ids = ()
    for key, value in sp.items():
        if value is None:  # SGLang reads null as the field's default
            continue
        if key in NEUTRAL:
            if value != NEUTRAL[key] or isinstance(value, bool) != isinstance(NEUTRAL[key], bool):
                raise BadRequest(f"sampling_params.{key} is not supported (only its default, {NEUTRAL[key]!r})",
                                 f"sampling_params.{key}")
        elif key == "stop_token_ids":
            stop_ids = _stop_token_ids(value, facts.vocab_size)
        elif key in OPENAI_NAME:
            body[OPENAI_NAME[key]] = value
        else:
            raise BadRequest(f"sampling_params.{key} is not supported", f"sampling_params.{key}")
    if "response_format" in body:
        body["response_format"] = _json_schema(body["response_format"])
    if on:
        body["logprobs"] = 0 if top is None else top
        if start is not None and start != -1:
            if not 0 <= start < len(ids):
                raise BadRequest(f"'logprob_start_len' must be -1 or a prompt position (0-{len(ids) - 1}), got {start}",
                                 "logprob_start_len")
            body["echo"] = True  # the completions' way to ask for the prompt's logprobs
    try:
        opts = parse_common(body, COMPLETION_KEYS)
        params = request_params(body, opts, len(ids), False, facts, grammar, DEFAULT_MAX_NEW_TOKENS)
    except BadRequest as e:
        raise _in_sglang_names(e, field) from None
    if stop_ids:
        params = dataclasses.replace(params, stop_token_ids=stop_ids)
    return One(ids, seeded(params, opts["n"]), opts["stop"], rid, opts["logprobs"],
               start if on and start is not None and start >= 0 else -1, text_in)


def _stop_token_ids(value, vocab_size: int) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value)):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of up to {MAX_STOP_TOKEN_IDS} token ids "
                         f"in [0, {vocab_size})", "sampling_params.stop_token_ids")
    return tuple(dict.fromkeys(value))


def _json_schema(value) -> dict:
    """SGLang's `json_schema` (JSON text, or the schema itself) as the OpenAI `response_format`."""
    schema = value
    if isinstance(value, str):
        try:
            schema = orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"sampling_params.json_schema is not valid JSON: {e}",
                             "sampling_params.json_schema") from None
    if not isinstance(schema, dict):
        raise BadRequest("sampling_params.json_schema must be a JSON schema object", "sampling_params.json_schema")
    return {"type": "json_schema", "json_schema": {"schema": schema}}


_OPENAI_WORDS = re.compile(r"\b(max_tokens|min_tokens|seed|response_format|logprobs)\b")


def _in_sglang_names(e: BadRequest, field: str) -> BadRequest:
    """The OpenAI path's error, naming the field as this request gave it."""
    def name(openai: str) -> str:
        if openai in ("logprobs", "prompt"):  # what the request's top level gave
            return "top_logprobs_num" if openai == "logprobs" else field
        return SGLANG_NAME.get(openai, openai)
    param = None if e.param is None else name(e.param)
    if param is not None and param not in TOP_KEYS:
        param = f"sampling_params.{param}"
    return BadRequest(_OPENAI_WORDS.sub(lambda m: name(m[1]), e.message), param, e.status, e.kind)


class Listing:
    """A JSON list that only grows, kept encoded: a stream event splices it whole (SGLang's events carry
    everything so far) for the cost of encoding its new entries once."""

    def __init__(self):
        self.encoded = bytearray(b"[")

    def extend(self, entries: list) -> None:
        if entries:
            self.encoded += (b"," if len(self.encoded) > 1 else b"") + orjson.dumps(entries)[1:-1]

    def json(self) -> orjson.Fragment:
        return orjson.Fragment(bytes(self.encoded + b"]"))


class Answers:
    """The answers of one call, built piece by piece (`add(i, piece)`, i: the engine request, prompts in
    order, each prompt's n samples together): `body()` the whole response, `event(i)` request i's
    stream event."""

    def __init__(self, tokenizer, call: Generate, jobs: list):
        self.tok, self.call, self.jobs = tokenizer, call, jobs
        self.items = [one for one in call.items for _ in one.samples]
        self.rids = [one.rid if len(one.samples) == 1 else f"{one.rid}-{j}" for one in call.items
                     for j in range(len(one.samples))]
        n = len(jobs)
        self.texts, self.finishes, self.counts = [""] * n, [None] * n, [0] * n
        self.ids, self.lps, self.tops = ([Listing() for _ in range(n)] for _ in range(3))
        self.prompt_lps: list = [None] * n  # the prompt's logprob lists, made once they came

    def _entry(self, one: One, logprob, token: int) -> list:
        return [logprob, token, self.tok.token_text(token) if one.text_in_logprobs else None]

    def add(self, i: int, piece) -> None:
        """Request i's next piece (`app.Piece`), or the RuntimeError that ended it (raised)."""
        if isinstance(piece, Exception):
            raise piece
        one = self.items[i]
        self.texts[i] += piece.text
        self.counts[i] = piece.n_tokens
        self.ids[i].extend(piece.tokens)
        if one.logprobs is not None and piece.tokens:
            lps = logprobs.from_bytes(piece.tokens_packed)
            self.lps[i].extend([self._entry(one, lp.logprob, t) for t, lp in zip(piece.tokens, lps)])
            if one.logprobs:
                self.tops[i].extend([[self._entry(one, p, t) for t, p in lp.top(one.logprobs)] for lp in lps])
        if piece.finish == "length":
            self.finishes[i] = {"type": "length", "length": one.samples[0].max_new_tokens}
        elif piece.finish is not None:  # an EOS or stop token (its id), a stop string, or aborted (None)
            self.finishes[i] = {"type": "stop", "matched": piece.matched}

    def _prompt_logprobs(self, i: int) -> tuple[list, list]:
        """(input_token_logprobs, input_top_logprobs) from logprob_start_len on (the prompt's first token
        has none: null)."""
        one, job = self.items[i], self.jobs[i]
        if one.start < 0 or job.prompt_logprobs is None:
            return [], []
        if self.prompt_lps[i] is None:
            pairs = list(zip(one.ids, job.prompt_logprobs))[one.start:]
            self.prompt_lps[i] = ([self._entry(one, None if lp is None else lp.logprob, t) for t, lp in pairs],
                                  [None if lp is None else [self._entry(one, p, k) for k, p in lp.top(one.logprobs)]
                                   for _, lp in pairs])
        return self.prompt_lps[i]

    def answer(self, i: int) -> dict:
        one, job = self.items[i], self.jobs[i]
        meta = {"id": self.rids[i], "finish_reason": self.finishes[i], "prompt_tokens": len(one.ids)}
        if one.logprobs is not None:
            tokens, tops = self._prompt_logprobs(i)
            meta |= {"input_token_logprobs": tokens, "output_token_logprobs": self.lps[i].json()}
            if one.logprobs:
                meta |= {"input_top_logprobs": tops, "output_top_logprobs": self.tops[i].json()}
        meta |= {"completion_tokens": self.counts[i], "cached_tokens": job.cached_tokens}
        return {"text": self.texts[i], "output_ids": self.ids[i].json(), "meta_info": meta}

    def event(self, i: int) -> dict:
        return self.answer(i) | ({"index": i} if self.call.batch else {})

    def body(self):
        answers = [self.answer(i) for i in range(len(self.jobs))]
        return answers if self.call.batch else answers[0]
