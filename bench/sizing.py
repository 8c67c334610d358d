"""Size a jeagle deployment on paper from measured single-GPU figures (docs/sizing.md).

Pure Python + numpy, no JAX, no GPU; prints one markdown table. For a request rate, prompt and output
length and a time-per-output-token goal: the batch a replica can run within the goal (the measured batch
points interpolated, never extrapolated), replicas (`--dp`) and GPUs, KV memory per replica, the stream's
bytes against a NIC, and a small simulation (Poisson arrivals, least-loaded routing, deterministic service)
giving p50 / p99 queueing delay.

    python bench/sizing.py --model smollm2 --rate 50 --prompt 200 --output 256 --tpot-ms 1.0
"""
import argparse
import heapq
import json
import math

import numpy as np

# Output tok/s of one replica by batch (generated tokens / wall, prefill included, greedy, 256 new tokens, bf16).
MEASURED = {
    # SmolLM2-135M-Instruct + shipped head (5,4,8), MT-bench: bench/RESULTS.md, 2026-12-01, H200
    ("smollm2", "engine", "target-only"): {1: 1009.9, 16: 15990.1, 48: 38788.8},
    ("smollm2", "engine", "eagle"): {1: 1927.3, 16: 25824.3, 48: 48725.2},
    # the same model through the server over HTTP, streamed, 1 / 32 clients: bench/RESULTS.md, 2026-11-28, H100 80GB
    ("smollm2", "http", "target-only"): {1: 951.0, 32: 25039.0},
    ("smollm2", "http", "eagle"): {1: 2079.0, 32: 27108.0},
    # Llama-3.1-8B shape (random weights, EAGLE-3 at simulated accept 4.68): bench/RESULTS.md, 2026-12-02, H200
    ("llama8b", "engine", "target-only"): {1: 231.6, 16: 3419.4},
    ("llama8b", "engine", "eagle"): {1: 718.6, 16: 7200.2},
    # the same shape at --tp 2, one replica = 2 GPUs: bench/RESULTS.md, 2026-11-23, 2 x H200
    ("llama8b-tp2", "engine", "target-only"): {1: 220.1, 16: 3584.4},
    ("llama8b-tp2", "engine", "eagle"): {1: 609.2, 16: 6740.1},
}
# Time to first token of an uncached prompt, p50 ms, one request at a time. SmolLM2: 1,265-1,339-token
# prompts, bench/RESULTS.md, 2026-11-26, H100 80GB; 8B shape: 1,000-token prefix + question (28-101 tokens),
# bench/RESULTS.md, 2026-11-27, H100 80GB (tp 2 not measured: tp 1's figure is used).
TTFT_MS = {"smollm2": {"target-only": 4.94, "eagle": 5.15}, "llama8b": {"target-only": 27.48, "eagle": 28.78}}
# Shapes (bench/common.py's SHAPES and DRAFT_VOCAB); weights and KV are derived from these, not measured.
SHAPES = {"smollm2": dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, head_dim=64,
                          tied=True, draft_vocab=8192),
          "llama8b": dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                          tied=False, draft_vocab=32000)}
GIB = 2 ** 30


def layer_params(s):
    return s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"]) + 3 * s["hidden"] * s["inter"]


def derived(model, system, dtype_bytes=2):
    """(weight bytes, KV bytes per token) of one replica: KV = layers x 2 (K, V) x kv_heads x head_dim x bytes,
    the EAGLE head's one layer added; weights = embedding (twice if untied) + layers (+ the head's layer, its
    3h -> h fc and draft lm_head)."""
    s = SHAPES[model.split("-")[0]]
    layers = s["layers"] + (1 if system == "eagle" else 0)
    params = s["vocab"] * s["hidden"] * (1 if s["tied"] else 2) + s["layers"] * layer_params(s)
    if system == "eagle":
        params += layer_params(s) + 3 * s["hidden"] ** 2 + s["draft_vocab"] * s["hidden"]
    return params * dtype_bytes, layers * 2 * s["kv_heads"] * s["head_dim"] * dtype_bytes


def event_bytes(tokens_per_event, chars_per_token, model):
    """One streamed chat event as the server writes it (jeagle/serve/protocol.py stream_chunk, compact JSON)."""
    obj = {"id": "chatcmpl-" + "0" * 32, "object": "chat.completion.chunk", "created": 1767225600, "model": model,
           "choices": [{"index": 0, "delta": {"content": "x" * round(tokens_per_event * chars_per_token)},
                        "finish_reason": None, "logprobs": None}]}
    return len(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def pick_batch(points, tpot_ms, cap):
    """The largest batch <= cap (and <= the largest measured) whose wall per output token (batch / tok/s)
    meets the goal; tok/s interpolated linearly between measured batches. None when batch 1 misses it."""
    xs, ys = np.array(sorted(points), float), np.array([points[k] for k in sorted(points)])
    best = None
    for b in range(1, int(min(cap, xs[-1])) + 1):
        tps = float(np.interp(b, xs, ys))
        if 1000.0 * b / tps <= tpot_ms:
            best = (b, tps)
    return best


def simulate(rate, dp, batch, service_s, n, seed):
    """Poisson arrivals; each request goes to the replica with the fewest in flight (queued included; ties:
    fewest routed), waits FIFO for one of its `batch` slots, holds it `service_s`. Queueing delays (s)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    slots = [[0.0] * batch for _ in range(dp)]
    inflight, routed, waits = [[] for _ in range(dp)], [0] * dp, np.empty(n)
    for i, t in enumerate(arrivals):
        for h in inflight:
            while h and h[0] <= t:
                heapq.heappop(h)
        r = min(range(dp), key=lambda k: (len(inflight[k]), routed[k]))
        start = max(t, heapq.heappop(slots[r]))
        heapq.heappush(slots[r], start + service_s)
        heapq.heappush(inflight[r], start + service_s)
        routed[r] += 1
        waits[i] = start - t
    return waits


def size(a):
    tp = 2 if a.model.endswith("-tp2") else 1
    points = MEASURED.get((a.model, a.source, a.system))
    if points is None:
        raise SystemExit(f"no measured figures for {a.model} / {a.source} / {a.system}")
    weights, kv_tok = derived(a.model, a.system)
    context = a.prompt + a.output
    kv_req = kv_tok * context
    kv_room = a.gpu_mem_gb * 1e9 * tp * a.mem_fraction - weights  # what the KV pool may take of the replica's GPUs
    kv_cap = max(1, int(kv_room // kv_req))
    chosen = pick_batch(points, a.tpot_ms, kv_cap)
    met = chosen is not None
    batch, tps = chosen if met else (1, points[min(points)])
    tpot = 1000.0 * batch / tps
    ttft = TTFT_MS[a.model.split("-")[0]][a.system]
    service = ttft / 1000.0 + a.output * tpot / 1000.0
    per_replica = batch / service
    dp = max(1, math.ceil(a.rate / (a.max_util * per_replica)))
    waits = simulate(a.rate, dp, batch, service, a.requests, a.seed)
    ev = event_bytes(a.tokens_per_event, a.chars_per_token, a.model.split("-")[0])
    net_bps = a.rate * a.output / a.tokens_per_event * ev * 8
    net_ceiling = a.nic_gbps * 1e9 / (a.output / a.tokens_per_event * ev * 8)
    limit = "latency goal" if met and batch < min(kv_cap, max(points)) else (
        "KV memory" if met and batch == kv_cap else ("largest measured batch" if met else "goal not met at batch 1"))
    rows = [("model / system / figures", f"{a.model} / {a.system} / {a.source}"),
            ("load", f"{a.rate:g} req/s, {a.prompt} + {a.output} tokens, goal {a.tpot_ms:g} ms per output token"),
            ("batch per replica (set by)", f"{batch} ({limit})"),
            ("replica tok/s at that batch", f"{tps:,.0f} (wall per output token {tpot:.2f} ms)"),
            ("request time in a slot", f"{service * 1000:,.1f} ms (TTFT {ttft:g} ms + {a.output} x {tpot:.2f} ms)"),
            ("replica capacity", f"{per_replica:,.1f} req/s"),
            ("replicas (--dp) x GPUs each (--tp)", f"{dp} x {tp} = {dp * tp} GPU{'s' if dp * tp > 1 else ''}, "
                                                   f"{a.rate / (dp * per_replica):.0%} busy"),
            ("KV per token / per request", f"{kv_tok / 1024:,.1f} KiB / {kv_req / 2 ** 20:,.1f} MiB"),
            ("KV per replica at the batch", f"{batch * kv_req / GIB:,.2f} GiB of {kv_room / GIB:,.1f} GiB room "
                                           f"(weights {weights / GIB:,.2f} GiB; fits {kv_cap:,} requests)"),
            ("queueing delay p50 / p99", f"{np.percentile(waits, 50) * 1000:,.1f} / "
                                         f"{np.percentile(waits, 99) * 1000:,.1f} ms ({a.requests:,} requests)"),
            ("stream out of the server", f"{net_bps / 1e6:,.1f} Mbit/s ({ev} B an event) of {a.nic_gbps:g} Gbit/s: "
                                         f"the NIC gives out at {net_ceiling:,.0f} req/s"),
            ("router (one HTTP process)", "CPU per request unmeasured: not modelled")]
    if a.json:
        print(json.dumps(dict(rows)))
        return
    print("| | |\n| --- | --- |")
    for k, v in rows:
        print(f"| {k} | {v} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=sorted({k[0] for k in MEASURED}))
    p.add_argument("--system", default="eagle", choices=["eagle", "target-only"])
    p.add_argument("--source", default="engine", choices=["engine", "http"],
                   help="the engine's tok/s by batch, or the server's over HTTP by clients (SmolLM2 only)")
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument("--prompt", type=int, default=200, help="mean prompt tokens")
    p.add_argument("--output", type=int, default=256, help="mean output tokens")
    p.add_argument("--tpot-ms", type=float, required=True, help="goal: wall ms per output token of a request")
    p.add_argument("--max-util", type=float, default=0.8, help="the busiest a replica is planned to be")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="one GPU's memory (H100 80, H200 141)")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="share of it for weights + KV")
    p.add_argument("--nic-gbps", type=float, default=10.0, help="the server host's NIC toward the clients")
    p.add_argument("--tokens-per-event", type=float, default=1.0, help="tokens a streamed event carries")
    p.add_argument("--chars-per-token", type=float, default=4.0)
    p.add_argument("--requests", type=int, default=20000, help="requests simulated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    size(p.parse_args())


if __name__ == "__main__":
    main()
