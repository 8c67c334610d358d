"""`python -m jeagle.serve`: an OpenAI-compatible HTTP server over the engine.

    POST /v1/completions, /v1/chat/completions   (streaming with "stream": true, server-sent events)
    GET  /v1/models, /health, /server_info, /metrics (Prometheus; --disable-metrics turns it off)

    POST /flush_cache (SGLang's: evict the prefix cache's unused entries)
    POST /generate (SGLang's native API: text or input_ids, sampling_params, batches, streaming)

One thread owns the engine and runs its scheduler (`Engine.submit / step / abort`): requests join the
running batch between steps, up to --max-running-requests, the rest wait in its queue. By default
that thread runs in a process of its own (`EngineProcess`), so the HTTP side's work never takes the
engine's GIL; `--engine-thread` keeps it in the server's process. HTTP handlers (Starlette on
uvicorn) validate a request completely before it reaches the engine — a bad one gets HTTP 400 with
an OpenAI-style error body and changes nothing; the engine's own checks (prompt length, slots) come
back as the request's first event, a 400 too — then talk to it through a command queue (a pipe to
the engine's process); tokens come back through per-request asyncio queues. A client that disconnects
mid-stream has its request aborted and its KV slots freed. Stop strings are matched on the decoded
text (held back while they might still be completing), and a match aborts the request.

Binds 127.0.0.1 by default. With --api-key (or JEAGLE_API_KEY) every endpoint but /health and /metrics
needs `Authorization: Bearer KEY` (compared in constant time; 401 otherwise).

    protocol.py      the OpenAI wire format: request checks, response bodies and chunks, stop strings
    engine_loop.py   the thread that owns the engine
    engine_process.py  that thread in a process of its own, and the pipe to it
    router.py        --dp N: N engine processes behind one link, each request routed by its prompt's prefix or load
    app.py           create_app: the routes and their handlers
    native.py        SGLang's /generate: its request → prompts and SamplingParams, its answers and events
    tools.py         tool calling: tools / tool_choice, the call parsers (--tool-call-parser), forced calls' grammars
    metrics.py       /metrics: the handlers' token counts and latencies, the engine's gauges
    options.py       the command line's options (ServeArgs) and `load`: EngineSpec → build_engine
    __main__.py      the command line: options → the engine's process → create_app → uvicorn
"""

from jeagle.serve.app import create_app

__all__ = ["create_app"]
