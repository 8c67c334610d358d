"""What bench/serve.py's load generator spends per streamed chunk (its `load()`: httpx streams, one JSON
parse per chunk), plain and with top-5 chat logprobs: a local server streams pre-built SSE chunks as fast
as it can, `--streams` of them at a time, to one client process whose CPU time is read. If a client
process's chunks per second times this cost nears one core, the load generator, not the server, bounds
a serve row (bench/serve.py spreads its clients over `--client-processes`).

    python bench/probes/client_cost.py --streams 8 --tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOP = [{"token": "Ġthe", "logprob": -1.2345678, "bytes": [32, 116, 104, 101]} for _ in range(5)]
ENTRY = {"token": "Ġthe", "logprob": -0.123456, "bytes": [32, 116, 104, 101], "top_logprobs": TOP}


def sse(obj) -> bytes:
    return ("data: " + json.dumps(obj) + "\n\n").encode()


def app():
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        body = await request.json()
        tokens = body["max_tokens"]
        chunk = sse({"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 1, "model": "bench",
                     "choices": [{"index": 0, "delta": {"content": " the"}, "finish_reason": None,
                                  "logprobs": {"content": [ENTRY]} if body.get("logprobs") else None}]})

        async def events():
            for i in range(tokens):
                yield chunk
                if i % 8 == 7:
                    await asyncio.sleep(0)
            yield sse({"choices": [], "usage": {"completion_tokens": tokens}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def client(url: str, tokens: int, streams: int, per_stream: int, extra: dict):
    """One client process's pass (serve.py's load): its CPU seconds less a one-token pass's (the event
    loop's and the HTTP client's set-up, not per chunk), wall and chunks."""
    from serve import run_load

    t0 = time.process_time()
    run_load(url, ["hi"], 1, range(streams), per_stream, extra, True)
    fixed = time.process_time() - t0
    t0 = time.process_time()
    res, start, end = run_load(url, ["hi"], tokens, range(streams), per_stream, extra, True)
    return time.process_time() - t0 - fixed, end - start, sum(r[2] for r in res)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8, help="concurrent streams in the client process")
    p.add_argument("--tokens", type=int, default=256, help="chunks per stream")
    p.add_argument("--per-stream", type=int, default=2, help="requests per stream")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    rows = []
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        pool.submit(client, f"http://127.0.0.1:{port}", 8, 2, 1, {}).result()  # untimed: the imports
        for _ in range(args.repeats):
            for name, extra in (("plain", {}), ("logprobs", {"logprobs": True, "top_logprobs": 5})):
                cpu, wall, chunks = pool.submit(client, f"http://127.0.0.1:{port}", args.tokens, args.streams,
                                                args.per_stream, extra).result()
                rows.append({"request": name, "chunks": chunks, "client_cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                             "client_us_per_chunk": round(1e6 * cpu / chunks, 1)})
                print(f"{name:>8}: {chunks} chunks, the client process's CPU {1e6 * cpu / chunks:.1f} us a chunk "
                      f"(wall {wall:.2f} s)", flush=True)
    server.should_exit = True
    print(json.dumps({"bench": "client_cost", "streams": args.streams, "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
