"""`python -m jeagle.serve`: an OpenAI-compatible HTTP server over the engine.

    POST /v1/completions, /v1/chat/completions   (streaming with "stream": true, server-sent events)
    GET  /v1/models, /health, /server_info

One thread owns the engine and runs its scheduler (`Engine.submit / step / abort`): requests join the
running batch between steps, up to --max-running-requests, the rest wait in its queue. HTTP handlers
(Starlette on uvicorn) validate a request completely before it reaches that thread — a bad one gets
HTTP 400 with an OpenAI-style error body and changes nothing — then talk to the thread through a
command queue; tokens come back through per-request asyncio queues. A client that disconnects
mid-stream has its request aborted and its KV slots freed. Stop strings are matched on the decoded
text (held back while they might still be completing), and a match aborts the request.

Binds 127.0.0.1 by default. With --api-key (or JEAGLE_API_KEY) every endpoint but /health needs
`Authorization: Bearer KEY` (compared in constant time; 401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from jeagle.sampling import SamplingParams
from jeagle.tokenizer import StreamDecoder

MAX_STOP_STRINGS = 4


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request validation ---------------------------------------------------------------------------
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "n",
          "user", "ignore_eos"}
COMPLETION_KEYS = COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "logprobs"}


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


# ---- the engine thread --------------------------------------------------------------------------------
@dataclass
class Job:
    """One request's link between its HTTP handler and the engine thread."""
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Any = None  # the engine's request, once submitted

    def emit(self, event) -> None:  # engine thread → handler
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineLoop(threading.Thread):
    """Owns the engine: applies submit/abort commands between steps, steps while there is work, and
    hands each job its tokens and its end."""

    def __init__(self, engine):
        super().__init__(daemon=True, name="jeagle-engine")
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # engine request index → job
        self.lock = threading.Lock()  # guards the counters /server_info reads
        self.info: dict = {}
        self.stopped = threading.Event()

    def submit(self, job: Job) -> None:
        self.commands.put(("submit", job))

    def abort(self, job: Job) -> None:
        self.commands.put(("abort", job))

    def stop(self) -> None:
        self.stopped.set()
        self.commands.put(("stop", None))

    def _apply(self, cmd, job) -> None:
        eng = self.engine
        if cmd == "submit":
            try:
                job.request = eng.submit(job.prompt, job.params, on_tokens=lambda _i, ids, j=job: j.emit(("tokens", ids)))
            except Exception as e:  # validated before, so this is rare (e.g. the pool is smaller than asked)
                job.emit(("error", str(e)))
                return
            self.jobs[job.request.index] = job
        elif cmd == "abort" and job.request is not None and not job.request.done:
            eng.abort(job.request)

    def run(self) -> None:
        eng = self.engine
        while not self.stopped.is_set():
            try:  # block for a command only when idle
                cmd, job = self.commands.get(block=not eng.has_work, timeout=None if not eng.has_work else 0)
                if cmd == "stop":
                    break
                self._apply(cmd, job)
                while True:
                    cmd, job = self.commands.get_nowait()
                    if cmd == "stop":
                        return
                    self._apply(cmd, job)
            except queue.Empty:
                pass
            if eng.has_work:
                try:
                    eng.step()
                except Exception as e:  # the engine is left idle; every job in flight fails
                    print(f"[jeagle.serve] engine step failed: {e!r}", file=sys.stderr, flush=True)
                    for j in list(self.jobs.values()):
                        if j.request is not None:
                            eng.abort(j.request)
                        j.emit(("error", f"engine failure: {e}"))
                    self.jobs.clear()
                    eng._pending.clear()
                    continue
            for index, j in list(self.jobs.items()):
                if j.request.done:
                    j.emit(("done", j.request.out.finish_reason))
                    del self.jobs[index]
            self._update_info()

    def _update_info(self) -> None:
        eng = self.engine
        # A server runs for days: keep the engine's per-round records bounded.
        if len(eng._acct["blocked_per_step"]) > 100_000:
            eng.reset_stats()
        if len(getattr(eng, "accept_lengths", ())) > 100_000:
            del eng.accept_lengths[:-512]
        info = {"running_requests": eng.num_running, "queued_requests": eng.num_waiting,
                "kv_slots_free": eng.allocator.free_count, "kv_slots_total": eng.allocator.num_slots - 1}
        if hasattr(eng, "spec"):
            acc = eng.accept_lengths[-512:]
            info["speculative_num_steps"] = eng.spec.num_steps
            info["speculative_tier"] = [eng.spec.num_steps, eng.spec.topk, eng.spec.num_draft_tokens]
            info["avg_spec_accept_length"] = sum(acc) / len(acc) if acc else None
        with self.lock:
            self.info = info


# ---- the app ------------------------------------------------------------------------------------------
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


def create_app(engine, tokenizer, model_name: str, api_key: str | None = None):
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from jeagle.engine import PromptTooLong

    loop_thread = EngineLoop(engine)
    reserve = getattr(engine, "_context_reserve", 0)
    created = int(time.time())

    def error(status, message, kind="invalid_request_error", param=None, code=None):
        return JSONResponse(error_body(message, kind, param, code), status_code=status)

    def authorized(request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    def unauthorized():
        return error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error",
                     code="invalid_api_key")

    def sampling(opts, n_prompt: int, chat: bool) -> SamplingParams:
        room = engine.max_ctx - n_prompt - reserve
        if room < 1:
            raise BadRequest(f"the prompt has {n_prompt} tokens; the context holds {engine.max_ctx} "
                             f"(with {reserve} reserved for speculation): no room for new tokens", "messages" if chat
                             else "prompt", kind="invalid_request_error")
        max_tokens = opts["max_tokens"]
        if max_tokens is None:
            max_tokens = room if chat else min(16, room)  # OpenAI: completions default to 16
        elif max_tokens > room:
            raise BadRequest(f"max_tokens {max_tokens} + the prompt's {n_prompt} tokens exceed the context of "
                             f"{engine.max_ctx} ({reserve} reserved for speculation): at most {room}", "max_tokens")
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=float(opts["temperature"]),
                                  top_k=max(0, opts["top_k"]), top_p=float(opts["top_p"]), seed=opts["seed"],
                                  ignore_eos=opts["ignore_eos"])
        except ValueError as e:
            raise BadRequest(str(e)) from e

    async def read_json(request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"invalid JSON: {e}") from e

    async def run_job(prompt_ids, params, stops, chat, stream, rid):
        """The response: streamed (SSE) or whole."""
        job = Job(prompt_ids, params, asyncio.get_running_loop())
        loop_thread.submit(job)
        decoder = StreamDecoder(tokenizer)
        matcher = StopMatcher(stops)
        eos = set(engine.model_cfg.eos_token_ids)

        async def pieces():
            """(text, finish_reason or None) as tokens arrive; aborts on a stop string."""
            n_tokens = 0
            while True:
                kind, value = await job.events.get()
                if kind == "tokens":
                    text = ""
                    for t in value:
                        n_tokens += 1
                        if t in eos and not params.ignore_eos:
                            continue
                        text += decoder.push(t)
                    out = matcher.push(text)
                    if matcher.stopped:
                        loop_thread.abort(job)
                        yield out, "stop", n_tokens
                        return
                    if out:
                        yield out, None, n_tokens
                elif kind == "done":
                    tail = matcher.push(decoder.flush()) + matcher.flush()
                    yield tail, ("stop" if value in ("stop", "abort") else value), n_tokens
                    return
                else:
                    raise RuntimeError(value)

        def chunk(text, finish, first=False):
            if chat:
                delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
                obj = "text_completion"
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice]}

        if stream:
            async def sse():
                try:
                    if chat:
                        yield f"data: {json.dumps(chunk('', None, first=True))}\n\n"
                    async for text, finish, _ in pieces():
                        if text or finish:
                            yield f"data: {json.dumps(chunk(text, finish))}\n\n"
                    yield "data: [DONE]\n\n"
                except (asyncio.CancelledError, GeneratorExit):
                    loop_thread.abort(job)  # the client went away: free its slots
                    raise
                except RuntimeError as e:
                    yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
                finally:
                    if job.request is None or not job.request.done:
                        loop_thread.abort(job)
            return StreamingResponse(sse(), media_type="text/event-stream")

        text, finish, n = "", None, 0
        try:
            async for piece, fin, n in pieces():
                text += piece
                finish = fin or finish
        except RuntimeError as e:
            return error(500, str(e), "server_error")
        except asyncio.CancelledError:
            loop_thread.abort(job)
            raise
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
            return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                                 "model": model_name, "choices": [choice], "usage": usage})
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                             "choices": [choice], "usage": usage})

    def check_model(body):
        if body.get("model") not in (None, model_name):
            raise BadRequest(f"model '{body.get('model')}' is not served here (this server: '{model_name}')", "model",
                             kind="invalid_request_error")

    async def completions(request):
        if not authorized(request):
            return unauthorized()
        try:
            body = await read_json(request)
            opts = parse_common(body, COMPLETION_KEYS)
            check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
                ids = list(prompt)
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)", "prompt")
            if not ids:
                raise BadRequest("'prompt' is empty", "prompt")
            params = sampling(opts, len(ids), chat=False)
            engine._make_request(0, ids, params)  # the engine's own checks (vocabulary, slots), nothing queued
        except BadRequest as e:
            return error(e.status, e.message, e.kind, e.param)
        except (PromptTooLong, ValueError) as e:
            return error(400, str(e), param="prompt")
        except ClientDisconnect:
            return error(400, "client disconnected")
        return await run_job(ids, params, opts["stop"], False, opts["stream"], f"cmpl-{uuid.uuid4().hex}")

    async def chat_completions(request):
        if not authorized(request):
            return unauthorized()
        try:
            body = await read_json(request)
            opts = parse_common(body, CHAT_KEYS)
            check_model(body)
            messages = body.get("messages")
            if (not isinstance(messages, list) or not messages
                    or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                               for m in messages)):
                raise BadRequest("'messages' must be a non-empty list of {role, content} objects with string content",
                                 "messages")
            if not tokenizer.has_chat_template:
                raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
            try:
                ids = tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
            except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
                raise BadRequest(f"chat template: {e}", "messages") from e
            params = sampling(opts, len(ids), chat=True)
            engine._make_request(0, ids, params)
        except BadRequest as e:
            return error(e.status, e.message, e.kind, e.param)
        except (PromptTooLong, ValueError) as e:
            return error(400, str(e), param="messages")
        except ClientDisconnect:
            return error(400, "client disconnected")
        return await run_job(ids, params, opts["stop"], True, opts["stream"], f"chatcmpl-{uuid.uuid4().hex}")

    async def models(request):
        if not authorized(request):
            return unauthorized()
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "jeagle"}]})

    async def health(request):
        return JSONResponse({"status": "ok" if loop_thread.is_alive() else "engine stopped"},
                            status_code=200 if loop_thread.is_alive() else 503)

    async def server_info(request):
        if not authorized(request):
            return unauthorized()
        with loop_thread.lock:
            info = dict(loop_thread.info)
        cfg = engine.cfg
        info |= {"model": model_name, "max_running_requests": engine.max_reqs, "max_context": engine.max_ctx,
                 "batch_buckets": list(engine.batch_buckets), "overlap": cfg.overlap,
                 "verify_done_wait": engine.verify_done.mode, "speculative": hasattr(engine, "spec"),
                 "adaptive": getattr(engine, "controller", None) is not None}
        info.setdefault("running_requests", engine.num_running)
        info.setdefault("queued_requests", engine.num_waiting)
        info.setdefault("kv_slots_free", engine.allocator.free_count)
        return JSONResponse(info)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop_thread.start()
        try:
            yield
        finally:
            loop_thread.stop()

    async def not_found(request, exc):
        return error(404, f"no route {request.url.path}", "not_found_error")

    async def bad_method(request, exc):
        return error(405, f"{request.method} not allowed on {request.url.path}", "invalid_request_error")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]),
                            Route("/health", health, methods=["GET"]),
                            Route("/server_info", server_info, methods=["GET"])],
                    lifespan=lifespan,
                    exception_handlers={404: not_found, 405: bad_method})
    app.state.engine_loop = loop_thread
    return app


def main(argv: list[str] | None = None) -> int:
    from jeagle.generate import adaptive_config, build_engine, build_parser, check_args

    p = build_parser("python -m jeagle.serve", prompts=False,
                     description="OpenAI-compatible server (default model: SmolLM2-135M-Instruct).")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JEAGLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (or JEAGLE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: the target's name)")
    a = p.parse_args(argv)
    check_args(p, a)
    from jeagle.errors import USER_ERRORS, report
    from jeagle.fetch import resolve_target
    from jeagle.tokenizer import Tokenizer

    try:
        adaptive = adaptive_config(a)
        target_dir = resolve_target(a.target, dtype=a.dtype, quiet=False)
        tokenizer = Tokenizer.from_dir(target_dir)
        engine, load_s = build_engine(a, target_dir, None, adaptive)
    except USER_ERRORS as e:
        return report(e)
    if a.warmup:
        engine.warmup(progress=True)
    name = a.served_model_name or target_dir.name
    import uvicorn

    print(f"[jeagle.serve] {name} loaded in {load_s:.1f} s; serving on http://{a.host}:{a.port}", file=sys.stderr)
    uvicorn.run(create_app(engine, tokenizer, name, a.api_key), host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
