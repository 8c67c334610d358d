"""`create_app(engine, tokenizer, model_name, api_key)`: the Starlette app, its routes and handlers.

A handler checks the key, checks the request completely (`protocol`, then `engine.check`, which
queues nothing) — a bad one gets HTTP 400 and changes nothing — then hands a `Job` to the engine
thread and answers from the job's events: streamed as server-sent events, or whole. A client that
goes away mid-stream has its request aborted, which frees its KV slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jeagle.engine import PromptTooLong
from jeagle.serve.engine_loop import EngineLoop, Job
from jeagle.serve.protocol import (CHAT_KEYS, COMPLETION_KEYS, BadRequest, StopMatcher, chat_prompt_ids,
                                   check_model, completion_body, completion_prompt_ids, error_body, parse_common,
                                   sampling_params, stream_chunk)
from jeagle.tokenizer import StreamDecoder


@dataclass(frozen=True)
class Served:
    """What every handler reads (`request.app.state.served`)."""
    engine: Any
    tokenizer: Any
    model_name: str
    api_key: str | None
    loop: EngineLoop
    created: int
    aliases: tuple[str, ...] = ()  # other names requests may give as `model` (besides "default")


def create_app(engine, tokenizer, model_name: str, api_key: str | None = None, aliases: tuple[str, ...] = ()
               ) -> Starlette:
    """aliases: names besides `model_name` and "default" that requests may give as `model` (the
    server passes the target's path as given and as resolved)."""
    served = Served(engine, tokenizer, model_name, api_key, EngineLoop(engine), int(time.time()),
                    tuple(a for a in aliases if a))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.loop.start()
        try:
            yield
        finally:
            served.loop.stop()

    app = Starlette(routes=[Route("/v1/completions", keyed(completions), methods=["POST"]),
                            Route("/v1/chat/completions", keyed(chat_completions), methods=["POST"]),
                            Route("/v1/models", keyed(models), methods=["GET"]),
                            Route("/health", health, methods=["GET"]),
                            Route("/server_info", keyed(server_info), methods=["GET"])],
                    lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.state.served = served
    app.state.engine_loop = served.loop
    return app


def error(status, message, kind="invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def keyed(handler):
    """`handler` behind the API key, when the server has one (compared in constant time)."""
    async def guarded(request: Request):
        api_key = request.app.state.served.api_key
        given = request.headers.get("authorization", "")
        if api_key is not None and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error",
                         code="invalid_api_key")
        return await handler(request)
    return guarded


# ---- the routes ---------------------------------------------------------------------------------------
async def completions(request: Request):
    return await complete(request, chat=False)


async def chat_completions(request: Request):
    return await complete(request, chat=True)


async def models(request: Request):
    s: Served = request.app.state.served
    return JSONResponse({"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created,
                                                     "owned_by": "jeagle"}]})


async def health(request: Request):
    alive = request.app.state.served.loop.is_alive()
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)


async def server_info(request: Request):
    s: Served = request.app.state.served
    eng = s.engine
    return JSONResponse(s.loop.info() | {
        "model": s.model_name, "max_running_requests": eng.max_running, "max_context": eng.max_context,
        "batch_buckets": list(eng.batch_buckets), "overlap": eng.config.overlap,
        "verify_done_wait": eng.verify_done_mode, "speculative": eng.speculative, "adaptive": eng.adaptive})


async def not_found(request: Request, exc):
    return error(404, f"no route {request.url.path}", "not_found_error")


async def bad_method(request: Request, exc):
    return error(405, f"{request.method} not allowed on {request.url.path}", "invalid_request_error")


# ---- a completion -------------------------------------------------------------------------------------
async def complete(request: Request, chat: bool):
    """Check the request, then run it: streamed or whole."""
    s: Served = request.app.state.served
    try:
        body = await read_json(request)
        opts = parse_common(body, CHAT_KEYS if chat else COMPLETION_KEYS)
        check_model(body, s.model_name, s.aliases)
        ids = chat_prompt_ids(body, s.tokenizer) if chat else completion_prompt_ids(body, s.tokenizer)
        params = sampling_params(opts, len(ids), chat, s.engine.max_context, s.engine.context_reserve)
        s.engine.check(ids, params)  # the engine's own checks (vocabulary, slots), nothing queued
    except BadRequest as e:
        return error(e.status, e.message, e.kind, e.param)
    except (PromptTooLong, ValueError) as e:
        return error(400, str(e), param="messages" if chat else "prompt")
    except ClientDisconnect:
        return error(400, "client disconnected")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    job = Job(ids, params, asyncio.get_running_loop())
    s.loop.submit(job)
    if opts["stream"]:
        return StreamingResponse(sse(s, job, opts["stop"], chat, rid), media_type="text/event-stream")
    return await whole(s, job, opts["stop"], chat, rid)


async def read_json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON: {e}") from e


async def pieces(s: Served, job: Job, stops: list[str]):
    """(text, finish_reason or None, tokens so far) as tokens arrive; aborts the job on a stop string.
    An engine error raises RuntimeError."""
    decoder, matcher = StreamDecoder(s.tokenizer), StopMatcher(stops)
    eos = set(s.engine.model_cfg.eos_token_ids)
    n_tokens = 0
    while True:
        kind, value = await job.events.get()
        if kind == "tokens":
            text = ""
            for t in value:
                n_tokens += 1
                if t in eos and not job.params.ignore_eos:
                    continue
                text += decoder.push(t)
            out = matcher.push(text)
            if matcher.stopped:
                s.loop.abort(job)
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


async def sse(s: Served, job: Job, stops: list[str], chat: bool, rid: str):
    """The streamed response's events; the job is aborted if the client goes away."""
    def event(text, finish, first=False):
        return f"data: {json.dumps(stream_chunk(rid, s.model_name, chat, text, finish, first))}\n\n"

    try:
        if chat:
            yield event("", None, first=True)
        async for text, finish, _ in pieces(s, job, stops):
            if text or finish:
                yield event(text, finish)
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        s.loop.abort(job)  # the client went away: free its slots
        raise
    except RuntimeError as e:
        yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
    finally:
        if job.request is None or not job.request.done:
            s.loop.abort(job)


async def whole(s: Served, job: Job, stops: list[str], chat: bool, rid: str):
    """The response in one JSON body, with its usage."""
    text, finish, n = "", None, 0
    try:
        async for piece, fin, n in pieces(s, job, stops):
            text += piece
            finish = fin or finish
    except RuntimeError as e:
        return error(500, str(e), "server_error")
    except asyncio.CancelledError:
        s.loop.abort(job)
        raise
    return JSONResponse(completion_body(rid, s.model_name, chat, text, finish, len(job.prompt), n))
