"""The server under load on loopback: request throughput and latency percentiles per concurrency, with
and without EAGLE.

`jeagle.serve`'s app in this process (uvicorn on 127.0.0.1), the engine warmed up first. By default
(`--model phased`) the models are bench/adaptive.py's (`common.phased_models`): a
SmolLM2-shaped target whose next token is a permutation of the current one (a step costs what
SmolLM2's does) and EAGLE-1 heads that accept every draft ("oracle") or none ("rejecting"), bracketing what a real head does; a
word-level tokenizer with one token per id (prompts are sent as token ids). Per configuration and
concurrency c: `--requests-per-client` × c streamed completions of `--prompt-len` random token ids
and `--max-tokens` new tokens (greedy, EOS ignored), c clients at a time. Reports request/s, output
tokens/s, time to first token and end-to-end latency p50 / p90 / p99. Prints a table, then one JSON
line. The clients run in a process of their own (as a load generator on another machine would): in
the server's process their JSON parsing would take the GIL from the engine thread (`--in-process-clients`
puts them back there, to see what that costs).

    python bench/serve.py --concurrency 1,8,32

`--model smollm2`: the real SmolLM2-135M-Instruct with the shipped EAGLE-3 head (configs
`target-only` and `eagle`, tier (5,4,8)) and its tokenizer; `--prompts` (MT-bench first turns, a
"prompt" per line) go as chat turns to /v1/chat/completions. With a grammar in `--extra`
(`response_format`, `regex`, `ebnf`) requests end at EOS, so output tokens come from each stream's
usage (`stream_options.include_usage`). Each concurrency gets an untimed pass first (one request
per client: the batch shapes it reaches compile there), then the timed one.

    python bench/serve.py --model smollm2 --prompts .data/mtbench.jsonl --concurrency 1,16 \
        --extra '{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}}'
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import socket
import sys
import threading
import time

from common import SHAPES, device_kind, git_commit, phased_models


def id_tokenizer(vocab: int):
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models

    from jeagle.loading.tokenizer import Tokenizer

    fast = Fast(models.WordLevel({f"<t{i}>": i for i in range(vocab)}, unk_token="<t0>"))
    fast.decoder = decoders.Fuse()
    return Tokenizer(fast, {"eos_token": "<t2>"})


def pct(xs, q):
    import numpy as np

    return float(np.percentile(xs, q)) if xs else None


GRAMMAR_FIELDS = ("response_format", "regex", "ebnf")
PENALTY_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens", "logit_bias")


async def load(url, prompts, max_tokens, clients, per_client, extra=None, chat=False):
    """Streamed requests, from the clients numbered `clients` (a range), `per_client` each: [(TTFT s,
    latency s, output tokens)], start and end (time.monotonic: one clock for every process of the
    machine). chat: prompts are texts sent as one user turn; else token id lists."""
    import httpx

    results = []
    constrained = any(k in (extra or {}) for k in GRAMMAR_FIELDS)

    async def client(c, k):
        for i in range(per_client):
            p = prompts[(k * per_client + i) % len(prompts)]
            body = ({"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p}) | {
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": not constrained, "stream": True,
                "stream_options": {"include_usage": True}} | (extra or {})
            t0 = time.perf_counter()
            first, n = None, None
            async with c.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            n = event["usage"]["completion_tokens"]
                        elif first is None:
                            first = time.perf_counter() - t0
            results.append((first, time.perf_counter() - t0, n))

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(clients) + 4)) as c:
        t0 = time.monotonic()
        await asyncio.gather(*[client(c, k) for k in clients])
        return results, t0, time.monotonic()


def run_load(*args):
    """`load` to completion (a client process's entry point)."""
    return asyncio.run(load(*args))


def prime_client():
    """A client process's first streamed request costs more than its next ones: httpx, httpcore and anyio
    import and set up their transport on first use (+60 ms on a 2-core CPU; on the GPU runner's host one
    client's first request in a fresh process read a TTFT of 140 ms against 3-4 ms after, bench/HISTORY.md
    2026-12-07). Each client process makes one request to a throwaway local server before any timing."""
    import httpx

    body = b"data: {}\n\n"

    async def go():
        async def reply(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # the request's JSON body, {}
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(reply, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            async with c.stream("POST", "/", json={}) as r:
                async for line in r.aiter_lines():
                    line.startswith("data: ") and json.loads(line[6:])
        server.close()
        await server.wait_closed()

    asyncio.run(go())


class Clients:
    """Where the load runs: `processes` spawned processes sharing the clients (kept for the whole
    bench; one process parsing 48 streams of top-5 logprobs was the bottleneck), or this one."""

    def __init__(self, in_process: bool, processes: int = 4):
        self.pool, self.processes = None, processes
        if not in_process:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            # Every process started and primed (`prime_client`) before timing.
            self.pool = ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn"), initializer=prime_client)
            for f in [self.pool.submit(time.sleep, 0.5) for _ in range(processes)]:
                f.result()
        else:
            prime_client()

    def __call__(self, url, prompts, max_tokens, concurrency, per_client, extra, chat):
        """[(TTFT, latency, tokens)] of every client's requests, and the wall from the first start to the
        last end."""
        if self.pool is None:
            res, t0, t1 = run_load(url, prompts, max_tokens, range(concurrency), per_client, extra, chat)
            return res, t1 - t0
        n = min(self.processes, concurrency)
        shares = [range(concurrency)[i::n] for i in range(n)]
        done = [f.result() for f in [self.pool.submit(run_load, url, prompts, max_tokens, share, per_client, extra,
                                                        chat) for share in shares]]
        return [r for res, _, _ in done for r in res], max(t1 for *_, t1 in done) - min(t0 for _, t0, _ in done)

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


def workload(model, shape, prompts_path, prompt_len):
    """The prompts: chat texts of `prompts_path` for smollm2, random token id lists for phased."""
    import numpy as np

    if model == "smollm2":
        from common import read_prompts

        return read_prompts(prompts_path, "Write a short story about a robot who learns to paint.")
    rng = np.random.default_rng(0)
    vocab = SHAPES[shape]["vocab_size"]
    return [[int(x) for x in rng.integers(10, vocab, prompt_len)] for _ in range(64)]


def tokenizer_for(model, shape, target_dir=None):
    from jeagle.loading.tokenizer import Tokenizer

    return Tokenizer.from_dir(target_dir) if model == "smollm2" else id_tokenizer(SHAPES[shape]["vocab_size"])


def bench_engine(model, shape, name, prompts_path, prompt_len, top, max_tokens, modes, overrides=None):
    """One configuration's engine, warmed up for the workload: (engine, tokenizer, {"warmup_s"}). Runs
    in the server's process or in an engine process of its own (EngineProcess's build)."""
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.serve.options import SERVER_DISPATCH_THREAD, SERVER_SLICE_FUSION
    from jeagle.speculative.round import SpecConfig

    prompts, target_dir = workload(model, shape, prompts_path, prompt_len), None
    if model == "smollm2":  # converted here (the first time): the server's process never touches the GPU
        from jeagle.loading.checkpoint import load_draft, load_model
        from jeagle.loading.fetch import resolve_draft, resolve_target
        from jeagle.heads import default_head_dir

        target_dir = resolve_target(None, quiet=True)
        target = load_model(target_dir)
        head = load_draft(resolve_draft(str(default_head_dir()), target_dir, quiet=True), target=target.cfg)
    else:
        target, head_params, head = phased_models(shape, 0.04)
    tok = tokenizer_for(model, shape, target_dir)
    lengths = [len(tok.encode_chat([{"role": "user", "content": t}])) for t in prompts] if target_dir else [prompt_len]
    buckets = tuple(sorted({1, 2, 4, 8, 16, 32, top} & set(range(1, top + 1))))
    # The server's kernel settings (python -m jeagle.serve: the environment's, slice fusions off) and its
    # dispatch thread (on), unless --engine-config says otherwise.
    kernels = dataclasses.replace(KernelSettings.from_env(), slice_fusion=SERVER_SLICE_FUSION)
    cfg = EngineConfig(**{"max_batch_size": top, "max_context": max(lengths) + max_tokens + 64,
                          "batch_buckets": buckets, "kernels": kernels, "dispatch_thread": SERVER_DISPATCH_THREAD}
                       | (overrides or {}))
    if name == "target-only":
        engine = target_only(target, cfg)
    else:
        engine = speculative(target, head, cfg, SpecConfig(5, 4, 8))
        if model != "smollm2":  # its params: (target params, draft params); the same graph, new draft weights
            dec = engine.decoder
            dec.params = (dec.params[0], head_params["high" if name == "eagle-oracle" else "low"])
    t0 = time.perf_counter()
    engine.warmup(prefill_lengths=sorted(set(lengths)), prefix=(False, True), progress=False, **modes)
    return engine, tok, {"warmup_s": round(time.perf_counter() - t0, 1), "target_dir": target_dir and str(target_dir)}


def slice_fusion() -> bool:
    """Whether the engines ran XLA's dynamic-slice fusions: the server's default (off), unless
    JEAGLE_XLA_OPTIONS names the option."""
    from jeagle.kernels.settings import KernelSettings
    from jeagle.serve.options import SERVER_SLICE_FUSION

    opts = dict(KernelSettings.from_env().xla_options)
    return bool(opts.get("xla_gpu_enable_dynamic_slice_fusion", SERVER_SLICE_FUSION))


def engine_host(before: dict, after: dict, wall: float) -> dict:
    """The engine's host time over a pass (its /server_info `host_totals` before and after): the share
    of the wall its steps spent busy (not waiting on the device; near 1: the host sets the pace) and
    waiting, ms per step in the round/decode dispatch, prefill calls and ms per call; the process's
    garbage collections (all, full) and their share of the wall."""
    d = {k: after[k] - before[k] for k in after}
    steps, prefills = max(d["steps"], 1), max(d["prefills"], 1)
    return {"steps": d["steps"], "busy_frac": round(d["busy_s"] / wall, 3), "blocked_frac": round(d["blocked_s"] / wall, 3),
            "dispatch_ms_per_step": round(1e3 * d["dispatch_s"] / steps, 3),
            "busy_ms_per_step": round(1e3 * d["busy_s"] / steps, 3), "prefills": d["prefills"],
            "prefill_dispatch_ms": round(1e3 * d["prefill_dispatch_s"] / prefills, 3),
            # Python's garbage collector in the engine's process (it stops the engine thread while it runs).
            "gc_collections": d.get("gc_collections"), "gc_full_collections": d.get("gc_full_collections"),
            "gc_frac": None if "gc_s" not in d else round(d["gc_s"] / wall, 4)}


def gc_label(host: dict) -> str:
    """The pass's garbage collections in the engine's process: "full/all wall-share" ("-" if unknown)."""
    if host.get("gc_frac") is None:
        return "-"
    return f"{host['gc_full_collections']}/{host['gc_collections']} {100 * host['gc_frac']:.1f}%"


def summarise(rows):
    """Per (config, concurrency, extra, clients, switch interval): the runs' output tok/s and their median,
    the median ÷ the same config's first extra (e.g. logprobs ÷ plain), and ÷ the first config's same row
    (e.g. EAGLE ÷ target-only); the median share of the wall the engine's steps kept its host busy."""
    import statistics

    keyed, busy, cpu, step_ms = {}, {}, {}, {}
    for r in rows:
        key = (r["config"], r["concurrency"], json.dumps(r["extra"], sort_keys=True), r["clients"], r["switch_interval"],
               r.get("metrics", "on"))
        keyed.setdefault(key, []).append(r["output_tokens_per_s"])
        busy.setdefault(key, []).append(r["engine_host"]["busy_frac"])
        cpu.setdefault(key, []).append(1e3 * r.get("server_cpu_s", 0.0) / max(r["requests"], 1))
        step_ms.setdefault(key, []).append(r["engine_host"]["busy_ms_per_step"])
    medians = {k: statistics.median(v) for k, v in keyed.items()}
    first_extra = {}
    for k in keyed:  # insertion order: a config's first extra comes first
        first_extra.setdefault(k[:2], k[2])
    config0 = next(iter(keyed))[0] if keyed else None
    out = []
    for k, v in keyed.items():
        name, c, extra, where, interval, metered = k
        base = medians[(name, c, first_extra[(name, c)], where, interval, metered)]
        other = medians.get((config0, c, extra, where, interval, metered))
        out.append({"config": name, "concurrency": c, "extra": json.loads(extra), "label": ",".join(json.loads(extra))[:24] or "-",
                    "clients": where, "switch_interval": interval, "tok_s": v, "tok_s_median": medians[k],
                    "vs_extra0": medians[k] / base, "vs_config0": None if name == config0 or not other else medians[k] / other,
                    "engine_busy_frac_median": statistics.median(busy[k]), "metrics": metered,
                    "server_cpu_ms_per_request_median": statistics.median(cpu[k]),
                    "engine_busy_ms_per_step_median": statistics.median(step_ms[k])})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="phased", choices=["phased", "smollm2"],
                   help="phased: random SmolLM2-shaped models, oracle/rejecting heads; smollm2: the real one")
    p.add_argument("--prompts", default=None, help="--model smollm2: .jsonl prompts (MT-bench first turns)")
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--configs", default=None,
                   help="default: target-only,eagle-oracle,eagle-rejecting (phased); target-only,eagle (smollm2)")
    p.add_argument("--engine", default="process", choices=["process", "thread"],
                   help="the engine in a process of its own (what python -m jeagle.serve runs) or in a thread of the "
                   "server's process (--engine-thread)")
    p.add_argument("--engine-config", default=None, metavar="JSON",
                   help='EngineConfig fields to override, e.g. {"prefix_cache": false} (rows say so)')
    p.add_argument("--clients", default="own", help="own: the clients in a process of their own (a load "
                   "generator elsewhere); in: in the server's process, sharing its GIL; own,in: both, rows say which")
    p.add_argument("--client-processes", type=int, default=4, help="processes the clients are spread over (own)")
    p.add_argument("--switch-intervals", default=None, metavar="S,...",
                   help="sys.setswitchinterval values for the server's process, a row each (default: Python's 0.005)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes per row, the rows of a concurrency interleaved; the summary gives medians")
    p.add_argument("--http", default="auto", choices=("auto", "h11", "httptools"),
                   help="uvicorn's HTTP implementation (auto: httptools when installed, as jeagle.serve runs)")
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="uvicorn's event loop (auto: uvloop when installed, as jeagle.serve runs)")
    p.add_argument("--metrics", default="on", metavar="on,off",
                   help="/metrics collected (on) or not (off), a row each: the server process's CPU time per pass "
                   "with and without, beside the engine's host time")
    p.add_argument("--extra", default=None, action="append", metavar="JSON",
                   help='more request fields, e.g. {"logprobs": 5} or {"frequency_penalty": 0.5}; repeat it for '
                   'rows of each (one warm-up covers them all)')
    args = p.parse_args(argv)
    extras = [json.loads(e) for e in args.extra or ["{}"]]
    modes = dict(greedy=(True,), logprobs=tuple({e.get("logprobs") is not None for e in extras}),
                 penalties=tuple({any(k in e for k in PENALTY_FIELDS) for e in extras}),
                 grammar=tuple({any(k in e for k in GRAMMAR_FIELDS) for e in extras}))
    metric_modes = args.metrics.split(",")
    if bad := sorted(set(metric_modes) - {"on", "off"}):
        p.error(f"--metrics {bad}: on or off")
    places = args.clients.split(",")
    if bad := sorted(set(places) - {"own", "in"}):
        p.error(f"--clients {bad}: own or in")
    intervals = [float(x) for x in args.switch_intervals.split(",")] if args.switch_intervals else [
        sys.getswitchinterval()]

    import httpx
    import uvicorn

    from jeagle.runtime.gc_clock import freeze_heap, gc_totals
    from jeagle.serve import create_app
    from jeagle.serve.engine_process import EngineProcess

    levels = [int(c) for c in args.concurrency.split(",")]
    clients = {where: Clients(where == "in", args.client_processes) for where in places}
    real = args.model == "smollm2"
    prompts = workload(args.model, args.shape, args.prompts, args.prompt_len)
    configs = (args.configs or ("target-only,eagle" if real else "target-only,eagle-oracle,eagle-rejecting")).split(",")
    if real and (bad := sorted(set(configs) - {"target-only", "eagle"})):
        p.error(f"--configs {bad}: --model smollm2 runs target-only and eagle")
    rows = []
    for name in configs:
        build = (args.model, args.shape, name, args.prompts, args.prompt_len, max(levels), args.max_tokens, modes,
                 json.loads(args.engine_config) if args.engine_config else None)
        if args.engine == "process":
            engine = EngineProcess(bench_engine, build)
            facts = engine.extra
        else:
            engine, _, facts = bench_engine(*build)
        warm, tok = facts["warmup_s"], tokenizer_for(args.model, args.shape, facts["target_dir"])
        freeze_heap()  # as python -m jeagle.serve does once its engine (thread or process) is ready
        app = create_app(engine, tok, "bench")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=args.http,
                                               loop=args.loop))
        th = threading.Thread(target=server.run, daemon=True)
        th.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        num_compiled = lambda: httpx.get(f"{url}/server_info", timeout=60).json()["compilations"]  # noqa: E731
        # JAX's own count of XLA compilations since the warm-up (any compile, not only the engine's executables)
        xla_compiled = lambda: httpx.get(f"{url}/server_info", timeout=60).json().get(  # noqa: E731
            "compilations_after_warmup")
        served, collector = app.state.served, app.state.served.metrics

        def host_totals():
            """The engine's host_totals once they stop moving (an engine process sends its counters at
            most every 50 ms: read too soon, a pass's last steps would count in no pass)."""
            last = None
            for _ in range(20):
                now = httpx.get(f"{url}/server_info", timeout=60).json()["host_totals"]
                if now == last:
                    return now
                last = now
                time.sleep(0.06)
            return last

        def grammar_rows(before=None):
            """EAGLE's grammar rows (walked by the host / masked per node, and why the walk left rows
            undecided: /server_info `grammar_rows`), since `before` if given."""
            now = httpx.get(f"{url}/server_info", timeout=60).json().get("grammar_rows")
            if before is None or now is None:
                return now
            und = {k: v - before["undecided"].get(k, 0) for k, v in now["undecided"].items()}
            return {"walked": now["walked"] - before["walked"], "masked": now["masked"] - before["masked"],
                    "compact_rounds": now.get("compact_rounds", 0) - before.get("compact_rounds", 0),
                    "undecided": {k: v for k, v in und.items() if v}}
        for c in levels:
            compiled = num_compiled()
            for extra in extras:  # untimed: this level's shapes, for every row's request
                clients[places[0]](url, prompts, args.max_tokens, c, 1, extra, real)
            warm_compiled = num_compiled() - compiled
            compiled = num_compiled()
            # The rows of one level interleaved, `--repeats` times: a host that slows down for a while (a
            # shared machine) slows every row of one repeat alike, not one row.
            for rep, extra, where, interval, metered in itertools.product(range(args.repeats), extras, places,
                                                                          intervals, metric_modes):
                sys.setswitchinterval(interval)
                object.__setattr__(served, "metrics", collector if metered == "on" else None)
                httpx.post(f"{url}/flush_cache", timeout=60)  # the timed pass starts with no prefix cached
                h0, g0 = host_totals(), grammar_rows()
                # The server's process: HTTP handlers, /metrics (with --clients in, the clients too).
                cpu0, gc0 = time.process_time(), gc_totals()
                res, wall = clients[where](url, prompts, args.max_tokens, c, args.requests_per_client, extra, real)
                server_cpu, gc1 = time.process_time() - cpu0, gc_totals()
                host = engine_host(h0, host_totals(), wall) | {"grammar_rows": grammar_rows(g0)}
                ttft = [r[0] for r in res]
                lat = [r[1] for r in res]
                n, tokens = len(res), sum(r[2] for r in res)
                rows.append({"config": name, "concurrency": c, "requests": n, "wall_s": wall, "extra": extra,
                             "http": args.http, "loop": args.loop, "clients": where, "switch_interval": interval,
                             "repeat": rep,
                             "model": args.model, "output_tokens": tokens, "compiled_in_untimed_pass": warm_compiled,
                             "requests_per_s": n / wall, "output_tokens_per_s": tokens / wall,
                             "ttft_ms": {q: 1e3 * pct(ttft, q) for q in (50, 90, 99)},
                             # one client: each request's, in order (which one a slow percentile is)
                             **({"ttft_ms_each": [round(1e3 * x, 2) for x in ttft]} if c == 1 else {}),
                             "latency_ms": {q: 1e3 * pct(lat, q) for q in (50, 90, 99)}, "warmup_s": warm,
                             "engine": args.engine, "engine_config": args.engine_config, "engine_host": host,
                             "metrics": metered, "server_cpu_s": server_cpu,
                             "server_gc": {"collections": gc1["gc_collections"] - gc0["gc_collections"],
                                           "full": gc1["gc_full_collections"] - gc0["gc_full_collections"],
                                           "ms": round(1e3 * (gc1["gc_s"] - gc0["gc_s"]), 2)},
                             "xla_compilations_after_warmup": xla_compiled(),
                             "compiled_in_timed_pass": num_compiled() - compiled})
                compiled = num_compiled()
        server.should_exit = True
        th.join(timeout=30)
    for c in clients.values():
        c.close()
    print(f"{'config':>16} {'engine':>7} {'extra':>24} {'clients':>7} {'switch':>6} {'conc':>4} {'req/s':>7} {'tok/s':>8} {'TTFT p50/p90/p99 ms':>22} "
          f"{'latency p50/p90/p99 ms':>24} {'busy':>5} {'ms/step':>7} {'dispatch':>8} {'gc':>9} {'metrics':>7} "
          f"{'srv cpu ms/req':>14} {'xla comp':>8}")
    for r in rows:
        t, lt = r["ttft_ms"], r["latency_ms"]
        label = ",".join(r["extra"])[:24] or "-"
        print(f"{r['config']:>16} {r['engine']:>7} {label:>24} {r['clients']:>7} {r['switch_interval']:>6.4f} {r['concurrency']:>4} {r['requests_per_s']:>7.2f} {r['output_tokens_per_s']:>8.0f} "
              f"{t[50]:>7.1f}/{t[90]:>6.1f}/{t[99]:>7.1f} {lt[50]:>8.1f}/{lt[90]:>7.1f}/{lt[99]:>7.1f} "
              f"{r['engine_host']['busy_frac']:>5.2f} {r['engine_host']['busy_ms_per_step']:>7.3f} "
              f"{r['engine_host']['dispatch_ms_per_step']:>8.3f} {gc_label(r['engine_host']):>9} {r['metrics']:>7} "
              f"{1e3 * r['server_cpu_s'] / max(r['requests'], 1):>14.2f} {str(r['xla_compilations_after_warmup']):>8}")
    summary = summarise(rows)
    if args.repeats > 1:
        print(f"medians of {args.repeats} interleaved passes (tok/s; ÷ the first --extra's row; ÷ {configs[0]}'s):")
        for r in summary:
            vs = "" if r["vs_config0"] is None else f" {r['vs_config0']:.3f}× {configs[0]}"
            print(f"{r['config']:>16} {r['label']:>24} {r['clients']:>7} {r['concurrency']:>4} metrics {r['metrics']:>3} "
                  f"{r['tok_s_median']:>8.0f} "
                  f"(runs {', '.join(f'{x:.0f}' for x in r['tok_s'])}) {r['vs_extra0']:.3f} of the first{vs}; "
                  f"engine busy {r['engine_busy_frac_median']:.2f} of the wall, "
                  f"{r['engine_busy_ms_per_step_median']:.3f} ms/step; server CPU "
                  f"{r['server_cpu_ms_per_request_median']:.2f} ms/request")
    print(json.dumps({"bench": "serve", "model": args.model, "shape": args.shape, "device": device_kind(),
                      "commit": git_commit(), "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "xla_options": os.environ.get("JEAGLE_XLA_OPTIONS"), "slice_fusion": slice_fusion(),
                      "rows": rows, "summary": summary}))


if __name__ == "__main__":
    main()
