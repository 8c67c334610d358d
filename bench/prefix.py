"""Prefix caching, slots on demand and retraction on SmolLM2-135M-Instruct, at the engine
level (submit / step, the server's engine loop without HTTP), EAGLE (the shipped head) and target-only.

ttft      A ~1,000-token system prompt shared by every request, one MT-bench question each, sent one
          after another (each after the previous finished): time to first token of the later requests
          with the prefix cache on vs off (the first request prefills the system prompt either way),
          and the accept length of both.
capacity  `--concurrent` requests at once with max_tokens = the context (real answers, EOS on) in a
          pool of `--pool-contexts` contexts: the old policy (every request reserves its whole
          context at admission, no cache) vs the default (slots on demand, retraction, prefix cache):
          output tokens/s, requests running at once, retractions, and how many outputs agree.
steady    the same clients in a closed loop (each sends its next request when its last one ends) for
          `--steady-seconds`: output tokens/s of a server kept busy, without capacity's drain.

    python bench/prefix.py --prompts .data/mtbench.jsonl --json-out bench/results/prefix.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from common import DRAFT_VOCAB, SHAPES, chat_ids, device_kind, emit, git_commit, random_eagle3_head, read_prompts


def system_prompt(tok, texts, tokens: int) -> str:
    """A system prompt of about `tokens` tokens: reference material made of questions the requests do
    not ask (the prompt file's second half)."""
    body, parts = "You are a careful assistant. Use the reference material below when it helps.\n\n", []
    for t in texts[len(texts) // 2:]:
        parts.append(t)
        if len(tok.encode(body + "\n\n".join(parts))) >= tokens:
            break
    return body + "\n\n".join(parts)


def compare(rows: list[dict], name: str, ratio) -> list[dict]:
    """Per system, the second row (the new way) gets `name` = ratio(first, second) and how many of its
    outputs equal the first row's."""
    for kind in {r["system"] for r in rows}:
        before, after = [r for r in rows if r["system"] == kind]
        after[name] = round(ratio(before, after), 2)
        after["same_tokens"] = sum(a == b for a, b in zip(before["tokens"], after["tokens"]))
    return rows


def reserve_policy(eng) -> None:
    """The policy before the prefix cache on a default engine: admission takes the request's whole context,
    which is never trimmed back (the default's `_trim_running` gives unused tails back before turning
    a request away: here that would trim the reservations, regrow them the next step, and so on)."""
    eng.kv.chunk = 1 << 30
    eng._trim_running = lambda: 0


def policy_engine(kind, policy, model, head, args, tier, prefill_lengths):
    """An engine of `--concurrent` rows over a pool of `--pool-contexts` contexts under `policy`
    ("reserve": the policy before the prefix cache; "on-demand": the default; "on-demand-eager": the default
    without admission control, `schedule_conservativeness` 0; "on-demand:C": that conservativeness),
    warmed up for these prompt lengths (prefills after cache hits included)."""
    from jeagle.engine import EngineConfig
    from jeagle.kernels.settings import KernelSettings

    n, ctx = args.concurrent, args.context
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if b < n) + (n,)
    ec = EngineConfig(max_batch_size=n, batch_buckets=buckets, max_context=ctx,
                      max_total_tokens=args.pool_contexts * ctx,
                      prefix_cache=policy.startswith("on-demand"), kernels=KernelSettings.from_env(),
                      schedule_conservativeness=conservativeness(policy))
    eng = make_engine(kind, model, head, ec, tier)
    if policy == "reserve":
        reserve_policy(eng)
    eng.warmup(prefill_lengths=sorted(prefill_lengths), greedy=(args.temperature == 0,), prefix=(False, True),
               progress=False)
    return eng


def conservativeness(policy: str) -> float:
    """The schedule_conservativeness of a policy: "on-demand:C" names one, "on-demand-eager" is 0."""
    if ":" in policy:
        return float(policy.split(":", 1)[1])
    return 0.0 if policy == "on-demand-eager" else 1.0


def make_engine(kind, model, head, ec, tier):
    from jeagle.engine import speculative, target_only
    from jeagle.speculative.round import SpecConfig

    return target_only(model, ec) if kind == "target-only" else speculative(model, head, ec, SpecConfig(*tier))


def ttft_prompts(tok, texts, args) -> tuple[list[list[int]], int]:
    """(prompt ids, shared prefix length): chat prompts of one system prompt and one question each."""
    system = system_prompt(tok, texts, args.system_tokens)
    asks = texts[: args.requests]
    ids = [tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in asks]
    return ids, len(tok.encode_chat([{"role": "system", "content": system}]))


def synthetic_prompts(args, vocab: int) -> tuple[list[list[int]], int]:
    """(prompt ids, shared prefix length) for a random-weight target: `--system-tokens` shared ids and a
    27-101-token question each (MT-bench's first turns' range under SmolLM2's chat template), drawn
    at random (time to first token depends on the lengths, not on which tokens)."""
    import random

    rng = random.Random(0)
    hi = min(vocab, 32000)
    shared = [rng.randrange(100, hi) for _ in range(args.system_tokens)]
    return [shared + [rng.randrange(100, hi) for _ in range(rng.randint(27, 101))]
            for _ in range(args.requests)], len(shared)


def ttft_rows(model, head, ids, shared, args, tier) -> list[dict]:
    from jeagle.engine import EngineConfig
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=args.ttft_new_tokens)
    rows = []
    for kind in args.systems.split(","):
        for cache in (False, True):
            ec = EngineConfig(max_batch_size=1, max_context=max(map(len, ids)) + args.ttft_new_tokens + 16,
                              prefix_cache=cache, kernels=KernelSettings.from_env())
            eng = make_engine(kind, model, head, ec, tier)
            eng.warmup(batch_sizes=[1], prefill_lengths=[len(p) for p in ids] + [len(p) - shared for p in ids],
                       greedy=(True,), prefix=(False, True), progress=False)
            for p in ids[:2]:  # a first run of every executable on the device
                eng.generate([p], sp)
            eng.flush_cache()
            ttft, acc, outs, rows_of = [], [], [], []
            for p in ids:
                out = eng.generate([p], sp)[0]
                ttft.append(out.time_to_first_token_s * 1e3)
                acc.append(eng.last_stats.accept_length)
                outs.append(out.token_ids)
                # the rows its prefill ran (its length bucket): the suffix after a cache hit, else the prompt
                rows_of.append(eng.buckets.prefill(1, len(p) - eng.last_stats.cached_tokens)[1])
                if eng.last_stats.compilations:
                    raise RuntimeError(f"{kind}: a timed request compiled")
            later = ttft[1:]
            by_bucket = {}
            for t, rows_t in zip(later, rows_of[1:]):
                by_bucket.setdefault(rows_t, []).append(t)
            row = {"scenario": "ttft", "shape": args.shape, "system": kind, "prefix_cache": cache, "requests": len(ids),
                   "prompt_tokens": [min(map(len, ids)), max(map(len, ids))], "shared_tokens": shared,
                   "ttft_first_ms": round(ttft[0], 2), "ttft_later_p50_ms": round(statistics.median(later), 2),
                   "ttft_later_mean_ms": round(statistics.fmean(later), 2),
                   # p50 and count per prefill length bucket: a p50 over two buckets is one of them
                   "ttft_later_p50_ms_by_prefill_rows": {str(k): [round(statistics.median(v), 2), len(v)]
                                                          for k, v in sorted(by_bucket.items())},
                   "accept_length": round(statistics.fmean(acc), 3) if kind == "eagle" else None, "tokens": outs}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return compare(rows, "ttft_speedup", lambda off, on: off["ttft_later_p50_ms"] / on["ttft_later_p50_ms"])


def capacity_rows(model, head, tok, texts, args, tier) -> list[dict]:
    from jeagle.sampling import SamplingParams

    ids = chat_ids(tok, texts)[: args.concurrent]
    ctx = args.context
    pool = args.pool_contexts * ctx
    # max_tokens = the context (capped per request at what its context leaves); sampled, as clients do:
    # greedy SmolLM2 often loops to the limit, which no policy can serve faster.
    sps = [SamplingParams(max_new_tokens=ctx, temperature=args.temperature, seed=i) for i in range(len(ids))]
    rows = []
    for kind in args.systems.split(","):
        for policy in ("reserve", "on-demand"):
            eng = policy_engine(kind, policy, model, head, args, tier, {len(p) for p in ids})
            eng.generate(ids[:4], [dataclasses.replace(sp, max_new_tokens=32) for sp in sps[:4]])
            eng.flush_cache()
            peak = []
            reqs = [eng.submit(p, sp) for p, sp in zip(ids, sps)]
            eng.reset_stats()
            while eng.has_work:
                eng.step()
                peak.append(eng.num_running)
            stats = eng.stats(reqs)
            new = sum(len(r.out.token_ids) for r in reqs)
            row = {"scenario": "capacity", "system": kind, "policy": policy, "requests": len(ids), "context": ctx,
                   "pool_slots": pool, "new_tokens": new, "wall_s": round(stats.wall_s, 3),
                   "tokens_per_s": round(new / stats.wall_s, 1), "peak_running": max(peak),
                   "mean_running": round(statistics.fmean(peak), 1), "retractions": stats.retractions,
                   "compilations_after_warmup": stats.compilations_after_warmup,
                   "finish": {k: sum(r.out.finish_reason == k for r in reqs) for k in ("stop", "length")},
                   "accept_length": round(stats.accept_length, 3) if kind == "eagle" else None,
                   "tokens": [r.out.token_ids for r in reqs]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return compare(rows, "vs_reserve", lambda old, new: new["tokens_per_s"] / old["tokens_per_s"])


def steady_rows(model, head, tok, texts, args, tier) -> list[dict]:
    """`--concurrent` clients, each sending its next request as soon as its last one finished (a closed
    loop: a server kept busy, not a batch draining), max_tokens = the context, for `--steady-seconds`:
    output tokens delivered per second in that window, the old policy vs the default. Without the
    drain the longest answers do not set the wall (they do in `capacity`)."""
    import time

    from jeagle.sampling import SamplingParams

    ctx = args.context
    ids = [p for p in chat_ids(tok, texts) if len(p) <= ctx // 2]  # room to answer in every context
    pool = args.pool_contexts * ctx
    rows = []
    for kind in args.systems.split(","):
        for policy in args.policies.split(","):
            # A retracted request resumes with its tokens so far: prefills after cache hits up to the context.
            eng = policy_engine(kind, policy, model, head, args, tier, {len(p) for p in ids} | {ctx})
            eng.generate(ids[:4], [SamplingParams(max_new_tokens=32, temperature=args.temperature, seed=i)
                                   for i in range(4)])
            eng.flush_cache()
            delivered = [0]
            sent = [0]
            running_samples = []

            def on_tokens(_i, new):
                delivered[0] += len(new)

            def send():
                n = sent[0]
                sent[0] += 1
                sp = SamplingParams(max_new_tokens=ctx, temperature=args.temperature, seed=n)
                return eng.submit(ids[n % len(ids)], sp, on_tokens=on_tokens)

            clients = [send() for _ in range(args.concurrent)]
            eng.reset_stats()
            t0 = time.perf_counter()
            finished = 0
            while time.perf_counter() - t0 < args.steady_seconds:
                eng.step()
                running_samples.append(eng.num_running)
                for c, r in enumerate(clients):
                    if r.done:
                        finished += 1
                        clients[c] = send()
            wall = time.perf_counter() - t0
            tokens = delivered[0]
            stats = eng.stats(clients)
            eng.abort_all()
            eng.check_kv()
            row = {"scenario": "steady", "system": kind, "policy": policy, "clients": args.concurrent,
                   "context": ctx, "pool_slots": pool, "seconds": round(wall, 3), "new_tokens": tokens,
                   "tokens_per_s": round(tokens / wall, 1), "requests_finished": finished,
                   "mean_running": round(statistics.fmean(running_samples), 1), "peak_running": max(running_samples),
                   "retractions": stats.retractions, "compilations_after_warmup": stats.compilations_after_warmup,
                   "new_token_ratio": eng.info()["new_token_ratio"],
                   "accept_length": round(stats.accept_length, 3) if kind == "eagle" else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for kind in {r["system"] for r in rows}:
        old = [r for r in rows if r["system"] == kind and r["policy"] == "reserve"]
        for r in rows:
            if old and r["system"] == kind and r["policy"] != "reserve":
                r["vs_reserve"] = round(r["tokens_per_s"] / old[0]["tokens_per_s"], 2)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=None, help=".jsonl with a 'prompt' per line (MT-bench first turns)")
    p.add_argument("--scenarios", default="ttft,capacity")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--requests", type=int, default=20, help="ttft: requests sent one after another")
    p.add_argument("--ttft-new-tokens", type=int, default=16)
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--pool-contexts", type=int, default=16, help="capacity: the pool holds this many contexts")
    p.add_argument("--temperature", type=float, default=0.7, help="capacity: sampling temperature (seed i per request)")
    p.add_argument("--steady-seconds", type=float, default=20.0, help="steady: the measured window")
    p.add_argument("--systems", default="target-only,eagle")
    p.add_argument("--policies", default="reserve,on-demand",
                   help="steady: the policies to run (reserve, on-demand, on-demand-eager, on-demand:C for "
                        "schedule_conservativeness C)")
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--shape", default="smollm2",
                   help="smollm2: the real model and its shipped head; another bench/common.py shape (llama8b, "
                        "tiny): random weights, a random EAGLE-3 head and made-up token ids, ttft only (what a "
                        "prefill costs on a larger model; accept lengths mean nothing there)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    scenarios = args.scenarios.split(",")
    if args.shape not in SHAPES:
        p.error(f"--shape: one of {', '.join(SHAPES)}, got {args.shape!r}")
    if args.shape != "smollm2" and scenarios != ["ttft"]:
        p.error("--shape other than smollm2 runs the ttft scenario only (capacity and steady need real answers' "
                "lengths)")
    tier = tuple(int(x) for x in args.tier.split(","))

    if args.shape == "smollm2":
        from jeagle.loading.checkpoint import load_draft, load_model
        from jeagle.loading.fetch import resolve_draft, resolve_target
        from jeagle.heads import default_head_dir
        from jeagle.loading.tokenizer import Tokenizer

        target_dir = resolve_target(None, quiet=True)
        head_dir = resolve_draft(str(default_head_dir()), target_dir, quiet=True)
        tok = Tokenizer.from_dir(target_dir)
        model = load_model(target_dir)
        head = load_draft(head_dir, target=model.cfg)
        texts = read_prompts(args.prompts, "Write a short story about a robot who learns to paint.")
        name = target_dir.name
    else:
        from jeagle.config import ModelConfig
        from jeagle.models.llama import random_model

        cfg = ModelConfig(**{**SHAPES[args.shape], "tie_word_embeddings": False})
        model = random_model(cfg)
        head = random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape))
        tok = texts = None
        name = f"random {args.shape}"
    doc = {"bench": "prefix", "model": name, "device": device_kind(), "commit": git_commit(),
           "tier": list(tier), "args": vars(args), "rows": []}
    if "ttft" in scenarios:
        ids, shared = ttft_prompts(tok, texts, args) if tok else synthetic_prompts(args, model.cfg.vocab_size)
        doc["rows"] += ttft_rows(model, head, ids, shared, args, tier)
    if "capacity" in scenarios:
        doc["rows"] += capacity_rows(model, head, tok, texts, args, tier)
    if "steady" in scenarios:
        doc["rows"] += steady_rows(model, head, tok, texts, args, tier)
    for r in doc["rows"]:
        r.pop("tokens", None)
    emit(doc, args.json_out)
    return doc


if __name__ == "__main__":
    main()
