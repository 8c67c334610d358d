"""The server under load on loopback: request throughput and latency percentiles per concurrency, with
and without EAGLE.

`jeagle.serve`'s app in this process (uvicorn on 127.0.0.1), the engine warmed up first. No trained
head exists yet (issue 8), so the models are bench/adaptive.py's (`common.phased_models`): a
SmolLM2-shaped target whose next token is a permutation of the current one (a step costs what
SmolLM2's does) and EAGLE-1 heads that accept every draft ("oracle") or none ("rejecting"), bracketing what a real head does; a
word-level tokenizer with one token per id (prompts are sent as token ids). Per configuration and
concurrency c: `--requests-per-client` × c streamed completions of `--prompt-len` random token ids
and `--max-tokens` new tokens (greedy, EOS ignored), c clients at a time. Reports request/s, output
tokens/s, time to first token and end-to-end latency p50 / p90 / p99. Prints a table, then one JSON
line.

    python bench/serve.py --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

from common import device_kind, git_commit, phased_models


def id_tokenizer(vocab: int):
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models

    from jeagle.tokenizer import Tokenizer

    fast = Fast(models.WordLevel({f"<t{i}>": i for i in range(vocab)}, unk_token="<t0>"))
    fast.decoder = decoders.Fuse()
    return Tokenizer(fast, {"eos_token": "<t2>"})


def pct(xs, q):
    import numpy as np

    return float(np.percentile(xs, q)) if xs else None


async def load(url, prompts, max_tokens, concurrency, per_client, extra=None):
    import httpx

    results = []

    async def client(c, k):
        for i in range(per_client):
            body = {"prompt": prompts[(k * per_client + i) % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True} | (extra or {})
            t0 = time.perf_counter()
            first, n = None, 0
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if first is None:
                            first = time.perf_counter() - t0
                        n += 1
            results.append((first, time.perf_counter() - t0))

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(c, k) for k in range(concurrency)])
        wall = time.perf_counter() - t0
    return results, wall


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--configs", default="target-only,eagle-oracle,eagle-rejecting")
    p.add_argument("--extra", default=None, metavar="JSON",
                   help='more request fields, e.g. {"logprobs": 5} or {"frequency_penalty": 0.5} (rows say so)')
    args = p.parse_args(argv)
    extra = json.loads(args.extra) if args.extra else {}
    modes = dict(greedy=(True,), logprobs=(extra.get("logprobs") is not None,),
                 penalties=(any(k in extra for k in ("frequency_penalty", "presence_penalty", "repetition_penalty",
                                                     "min_tokens", "logit_bias")),))

    import numpy as np
    import uvicorn

    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.serve import create_app
    from jeagle.spec.round import SpecConfig

    levels = [int(c) for c in args.concurrency.split(",")]
    target, head_params, head = phased_models(args.shape, 0.04)
    tok = id_tokenizer(target.cfg.vocab_size)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(10, target.cfg.vocab_size, args.prompt_len)] for _ in range(64)]
    top = max(levels)
    buckets = tuple(sorted({1, 2, 4, 8, 16, 32, top} & set(range(1, top + 1))))
    cfg = EngineConfig(max_batch_size=top, max_context=args.prompt_len + args.max_tokens + 64, batch_buckets=buckets,
                       kernels=KernelSettings.from_env())
    rows = []
    for name in args.configs.split(","):
        if name == "target-only":
            engine = target_only(target, cfg)
        else:
            engine = speculative(target, head, cfg, SpecConfig(5, 4, 8))
            dec = engine.decoder  # its params: (target params, draft params); the same graph, new draft weights
            dec.params = (dec.params[0], head_params["high" if name == "eagle-oracle" else "low"])
        t0 = time.perf_counter()
        engine.warmup(prefill_lengths=[args.prompt_len], progress=False, **modes)
        warm = time.perf_counter() - t0
        app = create_app(engine, tok, "bench")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=server.run, daemon=True)
        th.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(load(url, prompts, args.max_tokens, 2, 1, extra))  # first requests through every path
        for c in levels:
            res, wall = asyncio.run(load(url, prompts, args.max_tokens, c, args.requests_per_client, extra))
            ttft = [r[0] for r in res]
            lat = [r[1] for r in res]
            n = len(res)
            rows.append({"config": name, "concurrency": c, "requests": n, "wall_s": wall, "extra": extra,
                         "requests_per_s": n / wall, "output_tokens_per_s": n * args.max_tokens / wall,
                         "ttft_ms": {q: 1e3 * pct(ttft, q) for q in (50, 90, 99)},
                         "latency_ms": {q: 1e3 * pct(lat, q) for q in (50, 90, 99)},
                         "warmup_s": round(warm, 1),
                         "compilations_after_warmup": engine.num_compiled - len(engine.warmup_plan(
                             prefill_lengths=[args.prompt_len], **modes))})
        server.should_exit = True
        th.join(timeout=30)
    print(f"{'config':>16} {'conc':>4} {'req/s':>7} {'tok/s':>8} {'TTFT p50/p90/p99 ms':>22} "
          f"{'latency p50/p90/p99 ms':>24}")
    for r in rows:
        t, lt = r["ttft_ms"], r["latency_ms"]
        print(f"{r['config']:>16} {r['concurrency']:>4} {r['requests_per_s']:>7.2f} {r['output_tokens_per_s']:>8.0f} "
              f"{t[50]:>7.1f}/{t[90]:>6.1f}/{t[99]:>7.1f} {lt[50]:>8.1f}/{lt[90]:>7.1f}/{lt[99]:>7.1f}")
    print(json.dumps({"bench": "serve", "shape": args.shape, "device": device_kind(),
                      "commit": git_commit(), "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
