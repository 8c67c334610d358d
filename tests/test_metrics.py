"""`/metrics` (Prometheus text format) over real HTTP on the tiny models of tests/test_serve.py: the
counters against the requests' usage and /server_info, the histograms' counts, the gauges when idle;
no key needed, an off switch; and `metered`'s timing of pieces on its own."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_serve import MODEL, PROMPTS, idle_info, make_app, parts, start_server  # noqa: F401 (parts: a fixture)


def scrape(c: httpx.Client) -> dict:
    """{sample name: {labels (without model_name) as a sorted tuple: value}} of GET /metrics."""
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == MODEL
            out.setdefault(s.name, {})[tuple(sorted(labels.items()))] = s.value
    return out


def one(samples: dict, name: str) -> float:
    (value,) = samples[name].values()
    return value


def streamed_usage(c: httpx.Client, path: str, body: dict) -> tuple[dict, list[str]]:
    """A streamed request's usage (stream_options.include_usage) and its choices' finish reasons."""
    usage, finishes = None, []
    with c.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            finishes += [ch["finish_reason"] for ch in chunk["choices"] if ch.get("finish_reason")]
    return usage, finishes


def test_metrics_match_the_requests_and_server_info(parts):
    app, engine = make_app(parts)
    srv, thread, url = start_server(app)
    long_prompt = "jeagle serves text with speculative decoding " * 2  # 90 characters: past the cache's minimum
    calls = [  # (path, body, streamed)
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "ignore_eos": True}, False),
        ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": True}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}, False),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[4]}], "max_tokens": 24}, True),
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, False),
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, True),
        ("/v1/completions", {"prompt": "abc", "max_tokens": 6, "temperature": 0.8, "n": 2, "seed": 3}, False),
    ]
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            idle = scrape(c)
            assert one(idle, "jeagle:num_running_reqs") == 0 and one(idle, "jeagle:num_queue_reqs") == 0
            assert one(idle, "jeagle:prompt_tokens_total") == 0 and "jeagle:num_requests_total" not in idle
            assert "jeagle:spec_accept_length" not in idle  # before any round, left out (as /server_info does)
            prompt = generated = cached = requests = 0
            finishes: Counter = Counter()
            for i, (path, body, streamed) in enumerate(calls):
                if streamed:
                    usage, reasons = streamed_usage(c, path, body)
                else:
                    r = c.post(path, json=body)
                    assert r.status_code == 200, r.text
                    usage, reasons = r.json()["usage"], [ch["finish_reason"] for ch in r.json()["choices"]]
                    if i == 0:  # a stop string from the middle of its greedy text ends a last request there
                        text = r.json()["choices"][0]["text"]
                        assert len(text) >= 6, text
                        calls.append(("/v1/completions", body | {"stop": [text[3:5]]}, True))
                n = body.get("n", 1)  # each choice is a request of its own, counted with the prompt
                prompt += usage["prompt_tokens"] * n
                generated += usage["completion_tokens"]
                cached += usage["prompt_tokens_details"]["cached_tokens"] * n
                requests += n
                finishes.update(reasons)
            info = idle_info(c)
            got = scrape(c)
    finally:
        srv.should_exit = True
        thread.join(timeout=30)

    assert one(got, "jeagle:prompt_tokens_total") == prompt
    assert one(got, "jeagle:generation_tokens_total") == generated
    assert one(got, "jeagle:cached_tokens_total") == cached == info["cached_tokens_total"] > 0  # the repeated prompt
    assert one(got, "jeagle:cache_hit_rate") == pytest.approx(cached / prompt)
    assert {dict(k)["finished_reason"]: v for k, v in got["jeagle:num_requests_total"].items()} == finishes
    assert set(finishes) == {"stop", "length"}
    for name in ("jeagle:time_to_first_token_seconds", "jeagle:e2e_request_latency_seconds"):
        assert one(got, name + "_count") == requests and got[name + "_bucket"][(("le", "+Inf"),)] == requests
    ttft, e2e = one(got, "jeagle:time_to_first_token_seconds_sum"), one(got, "jeagle:e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e
    # Every token after a request's first piece is one observation (a piece of k: its interval / k, k times).
    itl = one(got, "jeagle:inter_token_latency_seconds_count")
    assert 0 < itl <= generated - requests and 0 < one(got, "jeagle:inter_token_latency_seconds_sum") < e2e
    buckets = got["jeagle:inter_token_latency_seconds_bucket"]
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative

    # The engine's gauges, as /server_info has them once idle.
    assert one(got, "jeagle:num_running_reqs") == info["running_requests"] == 0
    assert one(got, "jeagle:num_queue_reqs") == info["queued_requests"] == 0
    used = info["kv_slots_total"] - info["kv_slots_free"] - info["prefix_cache_evictable_slots"]
    assert one(got, "jeagle:num_used_tokens") == used == 0  # idle: cached prefixes only, all evictable
    assert one(got, "jeagle:token_usage") == used / info["kv_slots_total"]
    assert one(got, "jeagle:spec_accept_length") == info["avg_spec_accept_length"] > 1
    assert one(got, "jeagle:gen_throughput") == info["internal_states"][0]["last_gen_throughput"] > 0
    # The accept lengths of every request-round since start, as the engine's stats count them.
    rounds = engine.stats([]).speculative
    assert one(got, "jeagle:spec_accept_length_histogram_count") == rounds.rounds > 0
    assert one(got, "jeagle:spec_accept_length_histogram_sum") / rounds.rounds == pytest.approx(rounds.accept_length)
    per_le = got["jeagle:spec_accept_length_histogram_bucket"]
    assert [per_le[(("le", str(float(k))),)] for k in range(1, 4)] == [
        sum(int(rounds.accept_length_histogram[str(j)]) for j in range(1, k + 1)) for k in range(1, 4)]


def test_metrics_need_no_key_and_can_be_turned_off(parts):
    """/metrics answers without the API key (as vLLM's, whose key guards only /v1/*); the other routes
    still ask for it. create_app(metrics=False) (--disable-metrics) serves no /metrics."""
    from jeagle.serve import create_app

    app, _ = make_app(parts, api_key="s3cret", batch=2)
    target, head, tok = parts
    off = create_app(make_app(parts, batch=2)[1], tok, MODEL, metrics=False)
    servers = [start_server(app), start_server(off)]
    try:
        with httpx.Client(base_url=servers[0][2], timeout=60) as c:
            assert c.get("/server_info").status_code == 401
            assert one(scrape(c), "jeagle:num_running_reqs") == 0
        with httpx.Client(base_url=servers[1][2], timeout=60) as c:
            assert c.get("/metrics").status_code == 404 and c.get("/health").status_code == 200
    finally:
        for srv, thread, _ in servers:
            srv.should_exit = True
            thread.join(timeout=30)


def test_metered_times_pieces_as_they_pass():
    """`metered` on a stream of pieces: the first piece with tokens is the time to first token and
    counts the prompt and its cached tokens; a later piece of k tokens is k inter-token observations of
    its interval / k; the end is the finishing piece's reason, "error" on an engine failure, "abort" when
    the stream is closed early."""
    from jeagle.serve.app import Piece
    from jeagle.serve.metrics import Metrics, metered

    idle = {"running_requests": 0, "queued_requests": 0, "kv_slots_total": 10, "kv_slots_free": 10,
            "prefix_cache_evictable_slots": 0}
    metrics = Metrics(SimpleNamespace(info=lambda: idle), MODEL)
    s = SimpleNamespace(metrics=metrics)

    def stream(items, gap=0.02):
        @metered
        async def pieces(s, job, stops):
            for item in items:
                await asyncio.sleep(gap)
                if isinstance(item, Exception):
                    raise item
                yield item
        return pieces

    async def run(items, take=None):
        job = SimpleNamespace(arrived=time.perf_counter(), prompt=[1] * 7, cached_tokens=3)
        out, gen = [], stream(items)(s, job, [])
        try:
            async for p in gen:
                out.append(p.text)
                if take is not None and len(out) == take:
                    break
        except RuntimeError:
            out.append("raised")
        finally:
            await gen.aclose()
        return out

    # A held-back first token: the first piece carries 2 (TTFT once), then a piece of 3, then the end.
    assert asyncio.run(run([Piece("ab", None, 2), Piece("cde", None, 5), Piece("", "length", 5)])) == [
        "ab", "cde", ""]
    assert metrics.ttft.counts[-1] == 0 and sum(metrics.ttft.counts) == 1 and metrics.ttft.sum >= 0.02
    # The piece of 3: three observations of its interval / 3 (one bucket), their sum the interval.
    assert max(metrics.itl.counts) == sum(metrics.itl.counts) == 3 and metrics.itl.sum >= 0.02
    assert metrics.itl.bounds[metrics.itl.counts.index(3)] >= metrics.itl.sum / 3
    assert (metrics.prompt_tokens, metrics.cached_tokens, metrics.generation_tokens) == (7, 3, 5)
    assert metrics.requests == {"length": 1} and sum(metrics.e2e.counts) == 1
    assert asyncio.run(run([Piece("a", None, 1), RuntimeError("engine failure: x")])) == ["a", "raised"]
    assert asyncio.run(run([Piece("a", None, 1), Piece("b", None, 2), Piece("", "stop", 2)], take=1)) == ["a"]
    assert metrics.requests == {"length": 1, "error": 1, "abort": 1} and sum(metrics.e2e.counts) == 3
    assert (metrics.prompt_tokens, sum(metrics.ttft.counts)) == (21, 3)
