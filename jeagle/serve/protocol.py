"""The OpenAI wire format: a request body → checked options, prompt ids and `SamplingParams`; results
→ response bodies, stream chunks and error bodies; stop strings matched on the decoded text.

Everything here is plain data in, plain data out (no HTTP, no engine): a bad request raises
`BadRequest`, which the app turns into an OpenAI-style error body with its status.
"""

from __future__ import annotations

import time

from jeagle.sampling import SamplingParams

MAX_STOP_STRINGS = 4

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "n",
          "user", "ignore_eos"}
COMPLETION_KEYS = COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "logprobs"}


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


def parse_common(body: dict, allowed: set[str]) -> dict:
    """The options both endpoints share, checked: max_tokens, temperature, top_p, top_k, seed, stop,
    stream, ignore_eos (unknown keys and unsupported features are a BadRequest)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown parameter '{unknown[0]}'", unknown[0])
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is supported", "n")
    if body.get("logprobs") not in (None, False):
        raise BadRequest("logprobs are not supported", "logprobs")
    if body.get("echo"):
        raise BadRequest("echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise BadRequest("suffix is not supported", "suffix")
    if body.get("best_of", 1) not in (None, 1):
        raise BadRequest("only best_of = 1 is supported", "best_of")
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
    return {
        "max_tokens": _number(body, "max_completion_tokens", 1, integer=True) or _number(body, "max_tokens", 1,
                                                                                           integer=True),
        "temperature": _number(body, "temperature", 0.0, 2.0, default=1.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True),
        "top_k": _number(body, "top_k", -1, integer=True, default=0),
        "seed": _number(body, "seed", 0, 2**32 - 1, integer=True),
        "stop": stop, "stream": stream, "ignore_eos": ignore_eos,
    }


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


def chat_prompt_ids(body: dict, tokenizer) -> list[int]:
    """/v1/chat/completions' `messages` through the tokenizer's chat template."""
    messages = body.get("messages")
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects with string content",
                         "messages")
    if not tokenizer.has_chat_template:
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
    except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
        raise BadRequest(f"chat template: {e}", "messages") from e


def sampling_params(opts: dict, n_prompt: int, chat: bool, max_context: int, reserve: int) -> SamplingParams:
    """The request's SamplingParams; max_tokens checked against the room the context leaves (`reserve`
    positions kept free for speculation) and defaulted as OpenAI does (completions: 16)."""
    room = max_context - n_prompt - reserve
    if room < 1:
        raise BadRequest(f"the prompt has {n_prompt} tokens; the context holds {max_context} "
                         f"(with {reserve} reserved for speculation): no room for new tokens", "messages" if chat
                         else "prompt", kind="invalid_request_error")
    max_tokens = opts["max_tokens"]
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)  # OpenAI: completions default to 16
    elif max_tokens > room:
        raise BadRequest(f"max_tokens {max_tokens} + the prompt's {n_prompt} tokens exceed the context of "
                         f"{max_context} ({reserve} reserved for speculation): at most {room}", "max_tokens")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=float(opts["temperature"]),
                              top_k=max(0, opts["top_k"]), top_p=float(opts["top_p"]), seed=opts["seed"],
                              ignore_eos=opts["ignore_eos"])
    except ValueError as e:
        raise BadRequest(str(e)) from e


# ---- results out --------------------------------------------------------------------------------------
class StopMatcher:
    """Text → (text safe to emit, stopped). Holds back a tail that may be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops, self.buffer, self.stopped = stops, "", False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buffer += text
        hits = [(self.buffer.find(s), s) for s in self.stops if s in self.buffer]
        if hits:
            cut = min(i for i, _ in hits)
            out, self.buffer, self.stopped = self.buffer[:cut], "", True
            return out
        hold = max((k for s in self.stops for k in range(len(s) - 1, 0, -1) if self.buffer.endswith(s[:k])), default=0)
        out, self.buffer = self.buffer[: len(self.buffer) - hold], self.buffer[len(self.buffer) - hold:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


def stream_chunk(rid: str, model_name: str, chat: bool, text: str, finish: str | None, first: bool = False) -> dict:
    """One server-sent event's object (chat: the first carries the assistant role)."""
    if chat:
        delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice]}


def completion_body(rid: str, model_name: str, chat: bool, text: str, finish: str | None, n_prompt: int,
                    n_completion: int) -> dict:
    """A whole (not streamed) response with its usage."""
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": [choice], "usage": usage}
