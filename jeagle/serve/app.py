"""`create_app(engine, tokenizer, model_name, api_key)`: the Starlette app, its routes and handlers.

A handler checks the key, checks the whole request (`protocol`, then `engine.check`, which queues nothing) — a bad
one gets HTTP 400 and changes nothing — then hands a `Job` to the engine thread and answers from the job's events:
streamed as server-sent events, or whole. A client gone mid-stream has its request aborted, freeing its KV slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jeagle.sampling import logprobs
from jeagle.engine import PromptTooLong
from jeagle.serve import native
from jeagle.runtime.gc_clock import gc_totals
from jeagle.serve.engine_loop import EngineLoop, Job
from jeagle.serve.metrics import Metrics, metered
from jeagle.serve.protocol import (CHAT_KEYS, COMPLETION_KEYS, BadRequest, StopMatcher, TokenJSON,
                                   chat_logprobs_packed, chat_prompt_ids, check_model, choice_body, completion_body,
                                   completion_logprobs, completion_prompt_ids, error_body, parse_common,
                                   request_params, seeded, stream_chunk, usage_body, usage_chunk)
from jeagle.serve.tools import constrain, lark_grammar, resolve, tool_request
from jeagle.loading.tokenizer import StreamDecoder


@dataclass(frozen=True)
class Served:
    """What every handler reads (`request.app.state.served`)."""
    loop: Any  # the engine's link: an EngineLoop (a thread here) or an EngineProcess
    tokenizer: Any
    model_name: str
    api_key: str | None
    created: int
    aliases: tuple[str, ...] = ()  # other names requests may give as `model` (besides "default")
    grammars: dict = dataclasses.field(default_factory=dict)  # the GrammarBackend, built on first use
    token_json: TokenJSON | None = None  # chat logprobs' per-token JSON pieces (made from `tokenizer`)
    metrics: Metrics | None = None  # /metrics' series (None: --disable-metrics)
    tools: Any = None  # the tool-call format chat requests' tools are parsed in (`tools.Family`; None: not parsed)

    def __post_init__(self):
        if self.token_json is None:
            object.__setattr__(self, "token_json", TokenJSON(self.tokenizer))

    def grammar(self, kind: str, source, param: str | None = None):
        """A request's compiled grammar ("lark": a forced tool call's); a bad one: BadRequest naming `param`."""
        from jeagle.sampling.grammar import GrammarBackend, GrammarError

        param = param or ("response_format" if kind.startswith("json") else kind)
        if "backend" not in self.grammars:
            try:
                facts = self.loop.facts
                self.grammars["backend"] = GrammarBackend(self.tokenizer, facts.vocab_size, facts.eos_token_ids[0])
            except ImportError:
                raise BadRequest("structured outputs need llguidance: pip install 'jeagle[serve]'", param) from None
        try:
            backend = self.grammars["backend"]
            return lark_grammar(backend, source) if kind == "lark" else backend.compile(kind, source)
        except GrammarError as e:
            raise BadRequest(str(e), param) from None


def create_app(engine, tokenizer, model_name: str, api_key: str | None = None, aliases: tuple[str, ...] = (),
               metrics: bool = True, tool_call_parser: str = "auto") -> Starlette:
    """engine: an `Engine` (run by a thread of this process), an `EngineProcess` (its own) or a `Router` (--dp).
    aliases: names besides `model_name` and "default" that requests may give as `model` (the server
    passes the target's path as given and as resolved). metrics: serve Prometheus' /metrics.
    tool_call_parser: the format of the model's tool calls (`tools.PARSERS`; "auto": its chat template's)."""
    link = engine if hasattr(engine, "facts") else EngineLoop(engine)
    served = Served(link, tokenizer, model_name, api_key, int(time.time()), tuple(a for a in aliases if a),
                    metrics=Metrics(link, model_name) if metrics else None,
                    tools=resolve(tool_call_parser, tokenizer.chat_template))

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
                            Route("/server_info", keyed(server_info), methods=["GET"]),
                            Route("/flush_cache", keyed(flush_cache), methods=["POST"]),
                            Route("/generate", keyed(generate), methods=["POST"]),
                            *([Route("/metrics", served.metrics.endpoint, methods=["GET"])] if metrics else [])],
                    lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.state.served, app.state.engine_loop = served, served.loop
    return app


class JSONBody(JSONResponse):
    """A JSON response encoded with orjson (it splices the pre-encoded chat logprobs)."""

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


def sse_event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error(status, message, kind="invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONBody(error_body(message, kind, param, code), status_code=status)


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
    return JSONBody({"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created,
                                                     "owned_by": "jeagle"}]})


async def health(request: Request):  # replicas (`router`): 200 while one is alive, the ones down named
    link = request.app.state.served.loop
    alive, down = link.is_alive(), {"replicas_down": link.down()} if getattr(link, "down", list)() else {}
    return JSONBody({"status": "ok" if alive else "engine stopped"} | down, status_code=200 if alive else 503)


async def server_info(request: Request):
    s: Served = request.app.state.served
    f = s.loop.facts
    return JSONBody(s.loop.info() | {
        "model": s.model_name, "max_running_requests": f.max_running_requests, "max_context": f.max_context,
        "batch_buckets": list(f.batch_buckets), "overlap": f.overlap, "verify_done_wait": f.verify_done_wait,
        "speculative": f.speculative, "adaptive": f.adaptive, "slice_fusion": f.slice_fusion,
        "dispatch_thread": f.dispatch_thread, "bucket_shrink_ratio": f.bucket_shrink_ratio,
        "tool_call_parser": s.tools.name if s.tools else None, "http_process_gc": gc_totals()})  # engine's: host_totals


async def flush_cache(request: Request):
    """SGLang's POST /flush_cache: evict every cached prefix no running request uses, on every replica
    (applied before any request sent after this answer)."""
    request.app.state.served.loop.flush_cache()
    return JSONBody({"message": "prefix cache flushed"})


async def not_found(request: Request, exc):
    return error(404, f"no route {request.url.path}", "not_found_error")


async def bad_method(request: Request, exc):
    return error(405, f"{request.method} not allowed on {request.url.path}", "invalid_request_error")


# ---- a completion -------------------------------------------------------------------------------------
@dataclass
class Ask:
    """One checked request as the answer needs it."""
    rid: str
    chat: bool
    opts: dict
    prompt_ids: list[int]
    prompt_text: str  # what `echo` repeats (completions)
    tools: Any = None  # a chat request's `tools.ToolRequest`


async def complete(request: Request, chat: bool):
    """Check the request, then run it: `n` engine requests (one per choice), streamed or whole."""
    arrived = time.perf_counter()  # where /metrics' latencies start
    s: Served = request.app.state.served
    try:
        body = await read_json(request)
        opts = parse_common(body, CHAT_KEYS if chat else COMPLETION_KEYS)
        check_model(body, s.model_name, s.aliases)
        tools = tool_request(body, s.tools) if chat else None  # (a forced call: a grammar writes it)
        ids = chat_prompt_ids(body, s.tokenizer, tools and tools.rendered) if chat else completion_prompt_ids(
            body, s.tokenizer)
        params = constrain(tools, request_params(body, opts, len(ids), chat, s.loop.facts, s.grammar), s.grammar)
    except BadRequest as e:
        return error(e.status, e.message, e.kind, e.param)
    except (PromptTooLong, ValueError) as e:
        return error(400, str(e), param="messages" if chat else "prompt")
    except ClientDisconnect:
        return error(400, "client disconnected")
    prompt = body.get("prompt")
    prompt_text = (prompt if isinstance(prompt, str) else prompt[0] if isinstance(prompt, list) and isinstance(
        prompt[0], str) else s.tokenizer.decode(ids)) if not chat and opts["echo"] else ""
    ask = Ask(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", chat, opts, ids, prompt_text, tools)
    loop = asyncio.get_running_loop()
    # n choices: n requests, each with its own seed stream (seed + i when the request gives a seed).
    jobs = [Job(ids, p, loop, arrived=arrived) for p in seeded(params, opts["n"])]
    refused = await admitted(s, jobs, "messages" if chat else "prompt")
    if refused is not None:
        return refused
    if opts["stream"]:
        return StreamingResponse(sse(s, jobs, ask), media_type="text/event-stream")
    return await whole(s, jobs, ask)


async def admitted(s: Served, jobs: list[Job], param: str):
    """Submit the jobs; after the engine's own checks (prompt length, vocabulary, slots), None or a
    rejected one's error (every job aborted: a rejected request queued nothing)."""
    for job in jobs:
        s.loop.submit(job)
    for job in jobs:
        kind, value = await job.events.get()
        if kind in ("rejected", "error"):  # (an error: its engine's process exited before taking it)
            for other in jobs:
                s.loop.abort(other)
            message, status = value if kind == "rejected" else (value, 503)
            return error(status, message, *(("invalid_request_error", param) if status == 400 else
                                            ("server_error", None)))
    return None


async def read_json(request: Request):
    """The body, parsed by orjson: it stops at 1,024 levels of nesting with an error (the standard
    library's parser recursed into a RecursionError, a 500) and takes no NaN or Infinity, which no
    field accepts."""
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON body: {e}") from e


@dataclass
class Piece:
    text: str
    finish: str | None
    n_tokens: int  # the choice's tokens so far (its EOS included)
    ids: list | tuple = ()  # the tokens behind `text` when logprobs were asked ...
    packed: bytes = b""  # ... and their logprob blocks (`logprobs.to_bytes`)
    tokens: list | tuple = ()  # every token since the last piece, EOS and stop tokens included ...
    tokens_packed: bytes = b""  # ... and their logprob blocks, when asked
    matched: int | str | None = None  # what stopped the choice: a stop token's id or a stop string


def kept(ids: list[int], packed: bytes, keep: list[int]) -> tuple[list[int], bytes]:
    """The tokens at indices `keep` (increasing, not empty) of `ids` and their blocks of `packed`."""
    n = len(keep)
    if keep[-1] == n - 1:  # a prefix (an EOS only ever ends a request)
        return (ids if n == len(ids) else ids[:n]), packed[:n * logprobs.BLOCK_BYTES]
    row = logprobs.BLOCK_BYTES
    return [ids[i] for i in keep], b"".join([packed[i * row:(i + 1) * row] for i in keep])


@metered  # /metrics' token counts and latencies, taken as the pieces pass
async def pieces(s: Served, job: Job, stops: list[str]):
    """Pieces of one choice as its tokens arrive; aborts the job on a stop string (the tokens after
    the one that completed it are dropped, with their logprobs). An engine error raises RuntimeError."""
    decoder, matcher = StreamDecoder(s.tokenizer), StopMatcher(stops)
    ends = set(() if job.params.ignore_eos else s.loop.facts.eos_token_ids) | set(job.params.stop_token_ids)
    n_tokens, pending, held, held_lps, last = 0, None, [], [], None  # held: the tokens since the last piece
    while True:
        kind, value = pending or await job.events.get()
        pending = None
        if kind == "tokens":
            ids, lps, facts = value
            if facts is not None:
                job.cached_tokens, job.prompt_logprobs = facts["cached_tokens"], facts["prompt_logprobs"]
            while not job.events.empty():  # the handler fell behind: one piece for every queued step's tokens
                pending = job.events.get_nowait()
                if pending[0] != "tokens":
                    break
                ids, lps, pending = ids + pending[1][0], None if lps is None else lps + pending[1][1], None
            text, keep, last = "", [], ids[-1]
            held += ids
            if lps is not None:
                held_lps.append(lps)
            for i, t in enumerate(ids):
                n_tokens += 1
                if t in ends:
                    continue
                text += matcher.push(decoder.push(t))
                if lps is not None:
                    keep.append(i)
                if matcher.stopped:
                    s.loop.abort(job)
                    cut = len(held) - len(ids) + i + 1
                    yield Piece(text, "stop", n_tokens, *(kept(ids, lps, keep) if keep else ((), b"")), held[:cut],
                                b"".join(held_lps)[:cut * logprobs.BLOCK_BYTES], matcher.matched)
                    return
            if text or keep:
                yield Piece(text, None, n_tokens, *(kept(ids, lps, keep) if keep else ((), b"")), held,
                            b"".join(held_lps))
                held, held_lps = [], []
        elif kind == "done":
            tail = matcher.push(decoder.flush()) + matcher.flush()
            yield Piece(tail, "stop" if value in ("stop", "abort") else value, n_tokens, (), b"", held,
                        b"".join(held_lps), last if value == "stop" and last in ends else None)
            return
        else:
            raise RuntimeError(value)


async def merged(s: Served, jobs: list[Job], stops: list[str], each: list[list[str]] | None = None):
    """(choice index, Piece or RuntimeError) from every job as they come; stop strings `stops`, or one
    list per job (`each`: a /generate batch)."""
    each = each or [stops] * len(jobs)
    if len(jobs) == 1:  # no queue in between
        try:
            async for piece in pieces(s, jobs[0], each[0]):
                yield 0, piece
        except RuntimeError as e:
            yield 0, e
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, job):
        try:
            async for piece in pieces(s, job, each[i]):
                await queue.put((i, piece))
        except RuntimeError as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class LogprobsOut:
    """The `logprobs` objects of one choice, piece by piece (completions: text offsets run on)."""

    def __init__(self, s: Served, ask: Ask):
        self.tok, self.pieces, self.chat = s.tokenizer, s.token_json, ask.chat
        self.k, self.offset = ask.opts["logprobs"], 0

    def __call__(self, ids: list[int], packed: bytes, prefix: list | None = None):
        """The object for tokens `ids` with their packed blocks, after `prefix` (completions' echo:
        the prompt's (token, TokenLogprob or None) pairs)."""
        if self.k is None:
            return None
        if self.chat:
            return chat_logprobs_packed(self.pieces, ids, packed, self.k)
        pairs = (prefix or []) + list(zip(ids, logprobs.from_bytes(packed)))
        out = completion_logprobs(self.tok, pairs, self.k, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


def echo_pairs(ask: Ask, job: Job) -> list:
    """Completions' echo with logprobs: the prompt's (token, TokenLogprob or None) pairs."""
    return list(zip(ask.prompt_ids, job.prompt_logprobs or [None] * len(ask.prompt_ids)))


def cached_tokens(jobs: list[Job]) -> int:
    """The prompt's cached tokens as its first sample saw them (the others fork from its prefill)."""
    return jobs[0].cached_tokens


async def sse(s: Served, jobs: list[Job], ask: Ask):
    """The streamed response's events; the jobs are aborted if the client goes away."""
    def event(text, finish, index, first=False, logprobs=None, calls=None):
        return sse_event(stream_chunk(ask.rid, s.model_name, ask.chat, text, finish, first, index, logprobs, calls))

    out = [LogprobsOut(s, ask) for _ in jobs]
    tools = [ask.tools and ask.tools.output() for _ in jobs]  # each choice's tool-call parser, if any
    echo = not ask.chat and ask.opts["echo"]
    started, counts = [False] * len(jobs), [0] * len(jobs)
    try:
        if ask.chat:
            for i in range(len(jobs)):
                yield event("", None, i, first=True)
        async for i, piece in merged(s, jobs, ask.opts["stop"]):
            if isinstance(piece, RuntimeError):
                raise piece
            text, prefix = piece.text, None
            if echo and not started[i]:  # the prompt first, with its logprobs (they came with the prefill)
                text, prefix = ask.prompt_text + text, (echo_pairs(ask, jobs[i]) if out[i].k is not None else None)
            started[i], counts[i], finish, calls = True, piece.n_tokens, piece.finish, None
            if tools[i]:
                text, calls, finish = tools[i].push(text, finish)
            if text or finish or piece.ids or prefix or calls:
                yield event(text, finish, i, logprobs=None if out[i].k is None else out[i](piece.ids, piece.packed,
                                                                                             prefix), calls=calls)
        if ask.opts["include_usage"]:
            usage = usage_body(len(ask.prompt_ids), sum(counts), cached_tokens(jobs))
            yield sse_event(usage_chunk(ask.rid, s.model_name, ask.chat, usage))
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        for job in jobs:
            s.loop.abort(job)  # the client went away: free its slots
        raise
    except RuntimeError as e:
        yield sse_event(error_body(str(e), 'server_error'))
    finally:
        for job in jobs:
            if job.request is None or not job.request.done:
                s.loop.abort(job)


async def whole(s: Served, jobs: list[Job], ask: Ask):
    """The response in one JSON body: every choice, and the usage (the prompt counted once)."""
    n = len(jobs)
    texts, finishes, counts = [""] * n, [None] * n, [0] * n
    ids, packed = [[] for _ in range(n)], [[] for _ in range(n)]
    try:
        async for i, piece in merged(s, jobs, ask.opts["stop"]):
            if isinstance(piece, RuntimeError):
                raise piece
            texts[i] += piece.text
            finishes[i] = piece.finish or finishes[i]
            counts[i] = piece.n_tokens
            if piece.ids:
                ids[i].extend(piece.ids)
                packed[i].append(piece.packed)
    except RuntimeError as e:
        return error(500, str(e), "server_error")
    except asyncio.CancelledError:
        for job in jobs:
            s.loop.abort(job)
        raise
    choices = []
    for i in range(n):
        text, prefix, calls, parser = texts[i], None, None, ask.tools and ask.tools.output()
        if not ask.chat and ask.opts["echo"]:
            text = ask.prompt_text + text
            prefix = echo_pairs(ask, jobs[i]) if ask.opts["logprobs"] is not None else None
        if parser:
            text, calls, finishes[i] = parser.whole(text, finishes[i])
        choices.append(choice_body(ask.chat, i, text, finishes[i],
                                   LogprobsOut(s, ask)(ids[i], b"".join(packed[i]), prefix), calls))
    return JSONBody(completion_body(ask.rid, s.model_name, ask.chat, choices, len(ask.prompt_ids), sum(counts),
                                        cached_tokens(jobs)))


# ---- SGLang's native /generate ------------------------------------------------------------------------
async def generate(request: Request):
    """SGLang's POST /generate (`native`): text or token ids, one prompt or a batch, whole or streamed;
    its requests run as the OpenAI endpoints' do (the same checks, jobs and pieces)."""
    arrived, s = time.perf_counter(), request.app.state.served  # arrived: where /metrics' latencies start
    try:
        call = native.parse(await read_json(request), s.tokenizer, s.loop.facts, s.grammar)
    except BadRequest as e:
        return error(e.status, e.message, e.kind, e.param)
    except ClientDisconnect:
        return error(400, "client disconnected")
    jobs = [Job(one.ids, p, asyncio.get_running_loop(), arrived=arrived) for one in call.items for p in one.samples]
    refused = await admitted(s, jobs, call.field)
    if refused is not None:
        return refused
    answers = generate_answers(s, jobs, native.Answers(s.tokenizer, call, jobs), call.stream)
    if call.stream:
        return StreamingResponse(answers, media_type="text/event-stream")
    async with contextlib.aclosing(answers):
        return [last async for last in answers][-1]


async def generate_answers(s: Served, jobs: list[Job], answers, stream: bool):
    """/generate's answer: streamed, the answer so far of a piece's request after each piece, then
    [DONE]; whole, one response at the end."""
    try:
        async for i, piece in merged(s, jobs, [], [one.stops for one in answers.items]):
            answers.add(i, piece)
            if stream:
                yield sse_event(answers.event(i))
        yield b"data: [DONE]\n\n" if stream else JSONBody(answers.body())
    except RuntimeError as e:
        yield sse_event(error_body(str(e), "server_error")) if stream else error(500, str(e), "server_error")
    finally:  # ended, failed, or the client went away: free what still runs
        for job in jobs:
            if job.request is None or not job.request.done:
                s.loop.abort(job)
