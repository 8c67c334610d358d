"""Where a prefix-cache hit's time to first token goes: bench/prefix.py's `ttft` scenario
(a ~1,000-token system prompt shared by every request, one MT-bench question each, one request after
another), with the host's time in each part of the request's first scheduler steps and, with
`--trace`, the device's busy time between submit and first token.

    python bench/probes/ttft_phases.py --prompts .data/mtbench.jsonl [--systems eagle,target-only]
        [--cache on,off] [--small-prefill-unroll auto,loop,3] [--requests 12] [--trace DIR]

Per request (the first is not counted: it prefills the system prompt either way), the phases are
wall-clock host seconds from submit to the first token's delivery:
  tables    reading finished requests' slot tables and releasing them (into the prefix cache)
  admit     admission: prefix match, slots, prefill grouping (without the prefill dispatch)
  prefill   the prefill's dispatch (host)
  step      the first decode step or round's dispatch (host), dispatched before the prefill is read
  wait      waiting on the prefill's result (device)
  other     the rest of the first steps (reserve, bookkeeping)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import DRAFT_VOCAB, SHAPES, device_kind, emit, git_commit, random_eagle3_head, read_prompts  # noqa: E402
from prefix import make_engine, synthetic_prompts, system_prompt  # noqa: E402

PHASES = ("tables", "admit", "prefill", "step", "wait")


def instrument(eng, acc: dict):
    """Wrap the engine's parts so each adds its host seconds to acc[phase] (while acc['on'])."""
    def wrap(obj, name, phase):
        fn = getattr(obj, name)

        def timed(*a, **k):
            if not acc["on"]:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[phase] += time.perf_counter() - t
                if phase in ("prefill", "step"):
                    acc["nested"] += time.perf_counter() - t
        setattr(obj, name, timed)

    wrap(eng, "_ask_tables", "tables")
    wrap(eng, "_complete_releases", "tables")
    wrap(eng.decoder, "prefill", "prefill")
    wrap(eng.decoder, "step", "step")
    wrap(eng, "_process", "wait")
    admit = eng._admit_waiting

    def timed_admit():
        if not acc["on"]:
            return admit()
        t, n0, tab0 = time.perf_counter(), acc["nested"], acc["tables"]
        try:
            return admit()
        finally:
            # admission less what it spent in the prefill's dispatch and in table reads (counted there)
            acc["admit"] += time.perf_counter() - t - (acc["nested"] - n0) - (acc["tables"] - tab0)
    eng._admit_waiting = timed_admit


def run(kind, cache, model, head, ids, shared, args, tier, small_unroll="auto"):
    import dataclasses

    import jax

    from jeagle.engine import EngineConfig
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=args.new_tokens)
    ec = EngineConfig(max_batch_size=1, max_context=max(map(len, ids)) + args.new_tokens + 16,
                      prefix_cache=cache, kernels=KernelSettings.from_env())
    eng = make_engine(kind, model, head, ec, tier)
    if small_unroll != "auto":  # the unroll of prefills of <= SMALL_PREFILL_TOKENS (part of their step keys)
        value = {"loop": False, "full": True}[small_unroll] if small_unroll in ("loop", "full") else int(small_unroll)
        eng.decoder.static = dataclasses.replace(eng.decoder.static, unroll_small_prefill=value)
    t_warm = time.perf_counter()
    eng.warmup(batch_sizes=[1], prefill_lengths=[len(p) for p in ids] + [len(p) - shared for p in ids],
               greedy=(True,), prefix=(False, True), progress=False)
    warm_s = time.perf_counter() - t_warm
    for p in ids[:2]:
        eng.generate([p], sp)
    eng.flush_cache()
    acc = {"on": False, "nested": 0.0}
    instrument(eng, acc)
    rows = []
    for i, p in enumerate(ids):
        for k in PHASES:
            acc[k] = 0.0
        first = []
        req = eng.submit(p, sp, on_tokens=lambda _i, _n: first or first.append(time.perf_counter()))
        eng.reset_stats()
        tracing = args.trace and i == len(ids) - 1
        if tracing:
            jax.profiler.start_trace(f"{args.trace}/{kind}-{'on' if cache else 'off'}-{small_unroll}")
        acc["on"] = True
        steps = 0
        while not first:
            eng.step()
            steps += 1
        acc["on"] = False
        ttft = first[0] - req.t_submit
        while eng.has_work:
            eng.step()
        if tracing:
            jax.profiler.stop_trace()
        row = {"request": i, "prompt": len(p), "cached": req.cached_tokens, "steps_to_first": steps,
               "ttft_ms": round(ttft * 1e3, 3)}
        row |= {f"{k}_ms": round(acc[k] * 1e3, 3) for k in PHASES}
        row["other_ms"] = round((ttft - sum(acc[k] for k in PHASES)) * 1e3, 3)
        rows.append(row)
    later = rows[1:-1] if args.trace else rows[1:]  # the traced last request runs under the profiler
    summary = {"system": kind, "prefix_cache": cache, "small_prefill_unroll": small_unroll,
               "unroll_small_prefill": eng.decoder.static.unroll_small_prefill,
               "warmup_s": round(warm_s, 2), "requests": len(rows),
               "shared_tokens": shared, "prompt_tokens": [min(map(len, ids)), max(map(len, ids))]}
    for k in ("ttft", *PHASES, "other"):
        summary[f"{k}_ms_p50"] = round(statistics.median(r[f"{k}_ms"] for r in later), 3)
    summary["cached_p50"] = statistics.median(r["cached"] for r in later)
    summary["steps_to_first"] = sorted({r["steps_to_first"] for r in later})
    print(json.dumps(summary), flush=True)
    return summary, rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=None)
    p.add_argument("--systems", default="target-only,eagle")
    p.add_argument("--cache", default="on,off")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--small-prefill-unroll", default="auto",
                   help="comma list of the small prefills' layer unroll to compare: auto (the engine's), loop, "
                        "full, or k layers per iteration (with the cache on; off runs the engine's)")
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--dtype", default=None, help="default: the target's (bf16; pass float32 on a CPU)")
    p.add_argument("--trace", default=None, help="a jax.profiler trace of each configuration's last request")
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES),
                   help="smollm2: the real model and head; another shape: random weights, made-up ids "
                        "(bench/prefix.py --shape)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    if args.shape == "smollm2":
        from jeagle.loading.checkpoint import load_draft, load_model
        from jeagle.loading.fetch import resolve_draft, resolve_target
        from jeagle.heads import default_head_dir
        from jeagle.loading.tokenizer import Tokenizer

        target_dir = resolve_target(None, quiet=True, **({"dtype": args.dtype} if args.dtype else {}))
        head_dir = resolve_draft(str(default_head_dir()), target_dir, quiet=True)
        tok = Tokenizer.from_dir(target_dir)
        model = load_model(target_dir, dtype=args.dtype)
        head = load_draft(head_dir, target=model.cfg, dtype=args.dtype)
        texts = read_prompts(args.prompts, "Write a short story about a robot who learns to paint.")
        system = system_prompt(tok, texts, args.system_tokens)
        ids = [tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in texts[: args.requests]]
        shared = len(tok.encode_chat([{"role": "system", "content": system}]))
        name = target_dir.name
    else:
        from jeagle.config import ModelConfig
        from jeagle.models.llama import random_model

        cfg = ModelConfig(**{**SHAPES[args.shape], "tie_word_embeddings": False,
                             **({"dtype": args.dtype} if args.dtype else {})})
        model = random_model(cfg)
        head = random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape))
        ids, shared = synthetic_prompts(args, cfg.vocab_size)
        name = f"random {args.shape}"
    tier = tuple(int(x) for x in args.tier.split(","))
    doc = {"bench": "ttft_phases", "model": name, "device": device_kind(), "commit": git_commit(),
           "args": vars(args), "summary": [], "rows": []}
    for kind in args.systems.split(","):
        for c in args.cache.split(","):
            for u in args.small_prefill_unroll.split(",") if c == "on" else ["auto"]:
                summary, rows = run(kind, c == "on", model, head, ids, shared, args, tier, u)
                doc["summary"].append(summary)
                doc["rows"].append({"system": kind, "prefix_cache": c == "on", "small_prefill_unroll": u,
                                    "requests": rows})
    emit(doc, args.json_out)
    return doc


if __name__ == "__main__":
    main()
