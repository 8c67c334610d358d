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

    protocol.py      the OpenAI wire format: request checks, response bodies and chunks, stop strings
    engine_loop.py   the thread that owns the engine
    app.py           create_app: the routes and their handlers
    __main__.py      the command line: options → EngineSpec → build_engine → create_app → uvicorn
"""

from jeagle.serve.app import create_app

__all__ = ["create_app"]
