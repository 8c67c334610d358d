"""Adaptive engines against the static tier, paired run by run in one process (issue 22's "within 3 % of
the best static tier"): SmolLM2 + the shipped head on MT-bench first turns, greedy, EOS ignored.

Every system is an engine over the same loaded weights, warmed (and, for the throughput policy,
calibrated) before anything is timed; then `--runs` cycles, each running every system once on the same
prompts, the order rotated from cycle to cycle (A B C, B C A, ...), every run from a flushed prefix
cache and (adaptive) the initial tier. Separate processes of one configuration read 23.9k-28.2k tok/s
on one machine (bench/HISTORY.md session 31); runs paired within a cycle share the machine's state of
that moment, so the per-cycle ratio to `static` is the measurement, its median the figure.

Batch b times the first b questions in one batch; batch 1 times the first `--b1-questions` (5) one
after another (one question alone says little: its accept length swings with bf16 partings).
`--buckets batches` (the default) gives the engines the timed batch sizes as their only buckets: a batch
whose rows finish keeps its bucket to the end. `--buckets default` gives them the list a user gets (and
bench/decode.py uses): the batch shrinks through the smaller buckets as rows finish, and the policy decides
at each (session 38: the throughput policy lost 22 % there and not here). Each adaptive row then lists
its rounds' observed wall by tier and batch bucket (`observed_ms_by_tier_and_batch`, the controller's own
samples: the last 15 of each).

    python bench/probes/adaptive_paired.py --prompts .data/mtbench.jsonl --batch-sizes 1,16,48 \\
        --systems 'static' 'ema={}' 'throughput={"policy": "throughput"}' --runs 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_system(spec: str):
    """'static' | 'static=S,K,N' | 'NAME={AdaptiveConfig JSON}' → (name, tier or None, adaptive dict or None)."""
    name, _, rest = spec.partition("=")
    if name.startswith("static"):
        return name, tuple(map(int, rest.split(","))) if rest else None, None
    if not rest:
        raise SystemExit(f"system {spec!r}: NAME=JSON for an adaptive engine, or static[=S,K,N]")
    return name, None, json.loads(rest)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--batch-sizes", default="1,16,48")
    p.add_argument("--systems", nargs="+", default=["static", "ema={}", 'throughput={"policy": "throughput"}'])
    p.add_argument("--tier", default="5,4,8", help="the static tier, and the adaptive engines' base tier")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=8, help="cycles: each runs every system once")
    p.add_argument("--b1-questions", type=int, default=5)
    p.add_argument("--engine-config", default=None, metavar="JSON", help="EngineConfig fields for every engine")
    p.add_argument("--buckets", default="batches", choices=["batches", "default"],
                   help="the timed batch sizes as the only buckets, or the default list (docstring)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    from jeagle.adaptive import AdaptiveConfig
    from jeagle.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative
    from jeagle.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig
    from jeagle.tokenizer import Tokenizer

    from common import emit, git_commit
    from decode import chat_ids, read_prompts

    batches = [int(b) for b in args.batch_sizes.split(",")]
    systems = [parse_system(s) for s in args.systems]
    if systems[0][2] is not None:
        raise SystemExit("the first system is the reference: make it a static one")
    target_dir = resolve_target(None, quiet=True)
    head_dir = resolve_draft(str(default_head_dir()), target_dir, quiet=True)
    all_ids = chat_ids(Tokenizer.from_dir(target_dir), read_prompts(args.prompts, ""))
    need = max(max(batches), args.b1_questions)
    if len(all_ids) < need:
        raise SystemExit(f"{args.prompts}: {len(all_ids)} prompts, the batch sizes need {need}")
    ids = all_ids[:need]
    model = load_model(target_dir)
    head = load_draft(head_dir, target=model.cfg)
    base = tuple(map(int, args.tier.split(",")))
    buckets = tuple(sorted(set(batches))) if args.buckets == "batches" else None
    ec = EngineConfig(**{"max_batch_size": max(batches), "batch_buckets": buckets,
                         "max_context": max(map(len, ids)) + args.max_new_tokens + 16,
                         "kernels": KernelSettings.from_env(), **json.loads(args.engine_config or "{}")})
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engines = {}
    for name, tier, adaptive in systems:
        t0 = time.perf_counter()
        eng = speculative(model, head, ec, SpecConfig(*(tier or base)),
                          adaptive=AdaptiveConfig.from_dict(adaptive) if adaptive is not None else None)
        eng.warmup(batch_sizes=batches if buckets else range(1, max(batches) + 1),
                   prefill_lengths=sorted({len(x) for x in ids}), greedy=(True,),
                   prefix=(False, True), progress=False)
        for b in batches:  # untimed: the throughput policy calibrates its tiers at each bucket here
            eng.generate(ids[:b], sp)
        engines[name] = eng
        print(f"{name}: ready in {time.perf_counter() - t0:.1f} s", flush=True)

    def one(eng, b):
        """(tokens/s, mean accept length, round dispatches per tier, host ms per step) of one run at batch b:
        wall per round, and the engine's own per-step host means (busy: not waiting on the device;
        blocked: waiting; dispatch: inside the round's dispatch)."""
        eng.flush_cache()
        if eng.decoder.controller is not None:
            eng.decoder.reset_tier()
        groups = [[x] for x in ids[:args.b1_questions]] if b == 1 else [ids[:b]]
        n, wall, acc, tiers, host = 0, 0.0, [], {}, {"round": [], "busy": [], "blocked": [], "dispatch": []}
        for g in groups:
            t0 = time.perf_counter()
            outs = eng.generate(g, sp)
            wall += time.perf_counter() - t0
            n += sum(len(o.token_ids) for o in outs)
            st = eng.last_stats
            if st.compile_s:
                raise RuntimeError("a timed run compiled")
            acc.append(st.speculative.accept_length)
            host["round"].append(st.wall_s * 1e3 / max(st.steps, 1))
            for k, d in (("busy", st.host_busy_ms), ("blocked", st.host_blocked_ms), ("dispatch", st.host_dispatch_ms)):
                host[k].append((d or {}).get("mean", float("nan")))
            # dispatches per tier, from the tier history (round index -> the tier from then on)
            hist = sorted((int(i), tuple(t)) for i, t in st.speculative.tier_history.items())
            for (i, t), nxt in zip(hist, [h[0] for h in hist[1:]] + [st.speculative.round_dispatches]):
                tiers[str(list(t))] = tiers.get(str(list(t)), 0) + nxt - i
        return n / wall, statistics.fmean(acc), tiers, {k: statistics.fmean(v) for k, v in host.items()}

    rows = []
    names = [s[0] for s in systems]
    for b in batches:
        tps = {name: [] for name in names}
        accs = {name: [] for name in names}
        dispatches = {name: {} for name in names}
        hosts = {name: [] for name in names}
        for cycle in range(args.runs):
            order = names[cycle % len(names):] + names[:cycle % len(names)]
            for name in order:
                t, a, tiers, host = one(engines[name], b)
                hosts[name].append(host)
                tps[name].append(t)
                accs[name].append(a)
                for k, v in tiers.items():
                    dispatches[name][k] = dispatches[name].get(k, 0) + v
            print(f"batch {b} cycle {cycle}: " + ", ".join(f"{nm} {tps[nm][-1]:,.1f}" for nm in names), flush=True)
        ref = names[0]
        for name in names:
            ratios = [x / y for x, y in zip(tps[name], tps[ref])]
            row = {"batch": b, "system": name, "tok_s": [round(x, 1) for x in tps[name]],
                   "tok_s_median": round(statistics.median(tps[name]), 1),
                   "accept_length": round(statistics.fmean(accs[name]), 3),
                   "paired_ratio": [round(r, 4) for r in ratios],
                   "paired_ratio_median": round(statistics.median(ratios), 4),
                   "dispatches_per_tier": dispatches[name],
                   "host_ms_median": {k: round(statistics.median(h[k] for h in hosts[name]), 4)
                                      for k in hosts[name][0]},
                   "adaptive_state": (engines[name].decoder.adaptive_state()
                                      if engines[name].decoder.controller is not None else None)}
            if row["adaptive_state"] is not None:
                row["observed_ms_by_tier_and_batch"] = observed_by_bucket(engines[name].decoder)
            rows.append(row)
            print(f"batch {b} {name}: median {row['tok_s_median']:,.1f} tok/s, accept {row['accept_length']:.3f}, "
                  f"÷ {ref} paired median {row['paired_ratio_median']:.4f} "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f})"
                  + f", round dispatches by tier {dispatches[name]}; ms per round / host busy / blocked / dispatch "
                  + " / ".join(f"{v:.3f}" for v in row["host_ms_median"].values()), flush=True)
    doc = {"bench": "adaptive_paired", "commit": git_commit(), "systems": args.systems, "tier": args.tier,
           "buckets": args.buckets, "runs": args.runs, "max_new_tokens": args.max_new_tokens, "rows": rows}
    emit(doc, args.json_out)


def observed_by_bucket(decoder) -> dict:
    """{"S,K,N": {batch bucket: [median ms, samples]}}: the controller's observed round walls (its last
    `window` samples per tier and bucket; every run of the engine so far)."""
    out: dict = {}
    for (j, bucket), samples in sorted(decoder.controller.times.online.items(), key=lambda kv: kv[0]):
        if samples:
            tier = decoder.tiers[j]
            name = f"{tier.num_steps},{tier.topk},{tier.num_draft_tokens}"
            out.setdefault(name, {})[bucket[0]] = [round(statistics.median(samples), 4), len(samples)]
    return out


if __name__ == "__main__":
    main()
