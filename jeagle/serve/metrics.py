"""Prometheus `/metrics` for the server, named as SGLang's (`jeagle:` for its `sglang:` prefix) and
labelled by the served name (`model_name`).

Two kinds of series:

- What the HTTP side sees of each request (one per choice: `n` > 1 is `n` engine requests, each
  counted with its prompt, as SGLang counts them; the usage counts the prompt once): the token and
  request counters, and the latency histograms from the request's arrival at its handler to its first
  piece of tokens, between later pieces, and to its end. `metered` wraps the handlers' per-choice piece
  stream (`app.pieces`) to take them.
- Gauges that mirror the engine's counters (running and queued requests, KV use, the accept length),
  read from `loop.info()` when Prometheus scrapes: the engine's loop pays nothing for them.

Every update happens on the server's event loop, the one thread that runs the handlers and the scrape,
so the counts are plain numbers without locks; an observation is a bisect and two additions, not the
~2.5 µs of a `prometheus_client.Histogram.observe` (which takes locks for threads this never has),
paid for each streamed piece. `prometheus_client` builds the exposition from them at scrape time, from
a registry of the app's own: tests build many apps in one process, and the global registry would
refuse their second set of names.
"""

from __future__ import annotations

import contextlib
import functools
import time
from bisect import bisect_left
from collections import Counter

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from starlette.responses import Response

# SGLang's default buckets (its TokenizerMetricsCollector), so dashboards made for it read these alike.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)


class Distribution:
    """A histogram's counts per bucket (`le` bounds, then +Inf) and its sum."""

    __slots__ = ("bounds", "counts", "sum", "_le")

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]

    def observe(self, value: float, times: int = 1) -> None:
        """`value`, observed `times` times (a piece of several tokens: each its share of the interval)."""
        self.counts[bisect_left(self.bounds, value)] += times  # the first bound >= value: `le` is inclusive
        self.sum += value * times

    def family(self, name: str, doc: str, label: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["model_name"])
        cumulative, total = [], 0
        for le, c in zip(self._le, self.counts):
            total += c
            cumulative.append((le, total))
        fam.add_metric([label], cumulative, self.sum)
        return fam


class Metrics:
    """The app's series: the handlers update the counts (`metered`), `collect` reads them and the
    engine's info. `endpoint` is the route's handler."""

    def __init__(self, loop, model_name: str):
        self.loop, self.model_name = loop, model_name
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.requests: Counter = Counter()  # finish reason -> requests ended with it
        self.ttft, self.itl, self.e2e = Distribution(TTFT_BUCKETS), Distribution(ITL_BUCKETS), Distribution(E2E_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    # ---- the handlers' side -----------------------------------------------------------------------------
    def first_token(self, seconds: float, prompt_tokens: int, cached_tokens: int) -> None:
        # The prompt is counted once its prefill is done (with the first token), so the counters follow
        # the work as it happens rather than at each request's end.
        self.ttft.observe(seconds)
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def ended(self, finish: str, seconds: float) -> None:
        self.requests[finish] += 1
        self.e2e.observe(seconds)

    # ---- the scrape -------------------------------------------------------------------------------------
    def describe(self):
        return []  # nothing to check at registration (the registry is the app's own)

    def collect(self):
        m = self.model_name

        def counter(name, doc, value):
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([m], value)
            return fam

        def gauge(name, doc, value):
            fam = GaugeMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([m], value)
            return fam

        yield counter("jeagle:prompt_tokens_total", "Prompt tokens of the requests that got a first token.",
                      self.prompt_tokens)
        yield counter("jeagle:generation_tokens_total", "Generated tokens handed to the clients (EOS included).",
                      self.generation_tokens)
        yield counter("jeagle:cached_tokens_total", "Prompt tokens the prefix cache gave.", self.cached_tokens)
        fam = CounterMetricFamily("jeagle:num_requests_total", "Requests ended, by finish reason.",
                                  labels=["model_name", "finished_reason"])
        for reason, n in sorted(self.requests.items()):
            fam.add_metric([m, reason], n)
        yield fam
        yield self.ttft.family("jeagle:time_to_first_token_seconds",
                               "From the request's arrival to its first piece of tokens.", m)
        yield self.itl.family("jeagle:inter_token_latency_seconds",
                              "Between tokens after the first (a piece of k tokens: k times its interval / k).", m)
        yield self.e2e.family("jeagle:e2e_request_latency_seconds", "From the request's arrival to its end.", m)
        yield gauge("jeagle:cache_hit_rate", "Prompt tokens the prefix cache gave / prompt tokens, since start.",
                    self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0)

        info = self.loop.info()  # the engine's counters after its last step (a copy)
        yield gauge("jeagle:num_running_reqs", "Requests in the running batch.", info["running_requests"])
        yield gauge("jeagle:num_queue_reqs", "Requests waiting for admission.", info["queued_requests"])
        # As SGLang counts them: slots held by cached prefixes no request uses are free to take.
        total = info["kv_slots_total"]
        used = total - info["kv_slots_free"] - info["prefix_cache_evictable_slots"]
        yield gauge("jeagle:num_used_tokens", "KV slots in use.", used)
        yield gauge("jeagle:token_usage", "KV slots in use / KV slots.", used / total if total else 0.0)
        state = info.get("internal_states", [{}])[0]
        if "last_gen_throughput" in state:
            yield gauge("jeagle:gen_throughput", "Tokens/s the engine emitted over its last steps.",
                        state["last_gen_throughput"])
        if info.get("avg_spec_accept_length") is not None:  # speculative, once a round ran
            yield gauge("jeagle:spec_accept_length", "Tokens per request-round (bonus included), recent rounds.",
                        info["avg_spec_accept_length"])
        counts = info.get("spec_accept_length_counts")
        if counts:
            yield accept_histogram(counts, m)

    async def endpoint(self, request) -> Response:
        # Unkeyed even with --api-key, as vLLM does (its key guards only /v1/*; SGLang's spares /metrics
        # too): scrapers carry no key, and the series hold counts, not prompts or outputs.
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(self.registry), headers={"Content-Type": content_type})


def accept_histogram(counts: list[int], model_name: str) -> HistogramMetricFamily:
    """The request-rounds since start by tokens emitted (`counts[k]`: rounds that emitted k, the bonus
    token included), as the decoder counts them (`spec_accept_length_counts` in the engine's info)."""
    fam = HistogramMetricFamily("jeagle:spec_accept_length_histogram",
                                "Tokens per request-round (bonus included), every round since start.",
                                labels=["model_name"])
    cumulative, total = [], 0
    for k in range(1, len(counts)):
        total += counts[k]
        cumulative.append((floatToGoString(k), total))
    cumulative.append(("+Inf", total))
    fam.add_metric([model_name], cumulative, float(sum(k * c for k, c in enumerate(counts))))
    return fam


def metered(pieces):
    """`pieces(s, job, stops)` (the app's per-choice stream of `Piece`s), timed and counted into
    `s.metrics` when the app has them (without, the stream itself: nothing in between). The first piece
    with tokens ends the time to first token (a token whose text is held back, as a stop string's
    possible start or an incomplete character, counts when its text goes out, as the client sees it);
    each later piece of k tokens observes its interval / k k times, at one bisect per piece, as SGLang
    does for its chunks; the end is the finishing piece, an error, or the stream closed before either
    (the client went away: "abort")."""
    @functools.wraps(pieces)
    def watched(s, job, stops):
        metrics = getattr(s, "metrics", None)
        return pieces(s, job, stops) if metrics is None else _timed(pieces(s, job, stops), metrics, job)
    return watched


async def _timed(stream, metrics: Metrics, job):
    seen, last, finish, end = 0, job.arrived, "abort", None
    try:
        async with contextlib.aclosing(stream):
            async for piece in stream:
                n = piece.n_tokens
                if n != seen:
                    now = time.perf_counter()
                    if seen:
                        metrics.itl.observe((now - last) / (n - seen), n - seen)
                    else:  # (the request's cached tokens came with its first tokens event)
                        metrics.first_token(now - job.arrived, len(job.prompt), job.cached_tokens)
                    metrics.generation_tokens += n - seen
                    seen, last = n, now
                if piece.finish is not None:
                    finish, end = piece.finish, time.perf_counter()
                yield piece
    except RuntimeError:  # the engine failed the request
        finish = "error"
        raise
    finally:
        metrics.ended(finish, (end or time.perf_counter()) - job.arrived)
