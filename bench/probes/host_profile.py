"""Where the host's time per speculative round goes: `cProfile` over a warm generate().

Random SmolLM2-shaped target and EAGLE-1 head, `--batch` requests of `--context`-token prompts, tier
5,4,8, greedy, overlap on (dataflow wait unless --sync). Prints the wall ms per round and the top
functions by own time and by cumulative time, per round; then one JSON line.

    python bench/probes/host_profile.py --batch 1 --tokens 256
    python bench/probes/host_profile.py --real .data/mtbench.jsonl --batch 16 --waves 5 --trace   # continuous
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, git_commit, random_target_and_head  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per request (random head: one per round)")
    p.add_argument("--waves", type=int, default=1,
                   help="W x batch prompts in one generate() with at most `batch` running (continuous batching: "
                        "a finished row's next request is admitted and prefilled between rounds)")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--engine-config", default=None, metavar="JSON", help="EngineConfig overrides")
    p.add_argument("--kv-chunk", type=int, default=None, help="positions a request's slots grow by ahead of need")
    p.add_argument("--trace", action="store_true",
                   help="also a jax.profiler trace of one more run: the device's busy and idle time per round, "
                        "busy time by executable (HLO module) and the top kernels")
    p.add_argument("--real", default=None, metavar="PROMPTS.jsonl",
                   help="the real SmolLM2 target and the shipped head on these prompts (chat template), "
                        "not random weights: rounds accept what the head accepts")
    args = p.parse_args(argv)

    import numpy as np

    from jeagle.engine import EngineConfig, speculative
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig

    if args.real:
        from common import chat_ids, read_prompts

        from jeagle.loading.checkpoint import load_draft, load_model
        from jeagle.loading.fetch import resolve_draft, resolve_target
        from jeagle.heads import default_head_dir
        from jeagle.loading.tokenizer import Tokenizer

        target_dir = resolve_target(None, quiet=True)
        model = load_model(target_dir)
        head = load_draft(resolve_draft(str(default_head_dir()), target_dir, quiet=True), target=model.cfg)
        ids = chat_ids(Tokenizer.from_dir(target_dir), read_prompts(args.real, ""))
        prompts = [ids[i % len(ids)] for i in range(args.batch * args.waves)]
        args.context = max(len(p) for p in prompts)
    else:
        model, head = random_target_and_head(args.shape)
        rng = np.random.default_rng(0)
        prompts = [list(rng.integers(10, model.cfg.vocab_size, args.context)) for _ in range(args.batch * args.waves)]
    cfg = EngineConfig(max_batch_size=args.batch, max_context=args.context + args.tokens + 64,
                       batch_buckets=tuple(sorted({min(b, args.batch) for b in (1, 16, args.batch)})),
                       verify_done_wait="sync" if args.sync else "dataflow",
                       kernels=KernelSettings.from_env(), **json.loads(args.engine_config or "{}"))
    eng = speculative(model, head, cfg, SpecConfig(5, 4, 8))
    if args.kv_chunk:
        eng.kv.chunk = args.kv_chunk
    sp = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)

    def cold():  # every run starts without prefix-cache hits (the first prefilled these prompts)
        if hasattr(eng, "flush_cache"):  # trees before the prefix cache have none (this probe runs them too)
            eng.flush_cache()

    # Every executable the timed runs can reach (rows finish at different rounds: smaller buckets).
    plan = dict(batch_sizes=range(1, args.batch + 1), prefill_lengths=sorted({len(p) for p in prompts}),
                greedy=(True,), progress=False)
    try:  # prefills after a prefix-cache hit (chat prompts share the template's system line) too
        eng.warmup(**plan, prefix=(False, True))
    except TypeError:  # a tree before the prefix cache
        eng.warmup(**plan)
    eng.generate(prompts, sp)
    cold()
    before = (dict(getattr(eng, "host_totals", {})), getattr(eng, "tables_waited_s", 0.0))
    t0 = time.perf_counter()
    eng.generate(prompts, sp)
    wall = time.perf_counter() - t0
    st = eng.last_stats  # the unprofiled run's
    rounds = st.speculative.round_dispatches
    tokens = st.new_tokens
    totals = {k: eng.host_totals[k] - before[0][k] for k in ("prefills", "prefill_dispatch_s") if k in before[0]}
    totals["tables_waited_s"] = getattr(eng, "tables_waited_s", 0.0) - before[1]
    if args.waves > 1:  # continuous batching: what admission costs
        print(f"{len(prompts)} requests, at most {args.batch} running: {tokens / wall:.1f} tok/s, {rounds} rounds, "
              f"{totals.get('prefills', '?')} prefill dispatches ({1e3 * totals.get('prefill_dispatch_s', 0.0):.1f} ms "
              f"of host dispatch), finished slot tables waited for {1e3 * totals['tables_waited_s']:.1f} ms")
    if st.compile_s:
        print(f"warning: the timed run compiled for {st.compile_s:.2f} s")
    cold()
    prof = cProfile.Profile()
    prof.enable()
    eng.generate(prompts, sp)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls_per_round": nc / rounds,
                     "own_us_per_round": 1e6 * tt / rounds, "cum_us_per_round": 1e6 * ct / rounds})
    busy, disp = (getattr(st, "host_busy_ms", None) or {}).get("p50"), (getattr(st, "host_dispatch_ms", None) or {}).get("p50")
    split = ("" if busy is None or disp is None else f"; host per step p50: busy {busy:.3f} ms, of it the dispatch "
             f"{disp:.3f} ms, the rest (results read, admission, bookkeeping) {busy - disp:.3f} ms")
    print(f"batch {args.batch}: {1e3 * wall / rounds:.3f} ms per round unprofiled ({rounds} rounds, accept length "
          f"{st.accept_length:.2f}){split}")
    for key in ("own_us_per_round", "cum_us_per_round"):
        print(f"\n{'function':<70} {'calls':>6} {'own us':>8} {'cum us':>8}   (per round, by {key.split('_')[0]})")
        for r in sorted(rows, key=lambda r: -r[key])[: args.top]:
            print(f"{r['function'][:70]:<70} {r['calls_per_round']:>6.1f} {r['own_us_per_round']:>8.1f} "
                  f"{r['cum_us_per_round']:>8.1f}")
    device = trace_device(eng, prompts, sp, cold, rounds, args.top) if args.trace else None
    print(json.dumps({"bench": "host_profile", "shape": args.shape, "device": device_kind(),
                      "commit": git_commit(), "batch": args.batch, "waves": args.waves, "timed_run_host": totals,
                      "ms_per_round": 1e3 * wall / rounds, "host_busy_ms_p50": busy, "host_dispatch_ms_p50": disp,
                      "device_trace": device,
                      "top_own": sorted(rows, key=lambda r: -r["own_us_per_round"])[: args.top]}))


def trace_device(eng, prompts, sp, cold, rounds: int, top: int) -> dict:
    """One more cold run under jax.profiler: the device's busy time (overlapping ops merged) and its
    idle time between the first and the last op, per round; busy time per round by HLO module
    (which executable) and by kernel name."""
    import collections
    import tempfile

    import jax

    from common import device_events_by_device, idle_gaps

    cold()
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            eng.generate(prompts, sp)
        traced = time.perf_counter() - t0
        events = [e for evs in device_events_by_device(d, with_module=True).values() for e in evs]
    if not events:
        print("\nno device ops in the trace (a CPU run)")
        return {}
    idle, _ = idle_gaps(events)
    busy = max(e[2] + e[1] for e in events) - min(e[2] for e in events) - idle  # overlapping ops merged
    by_module, by_kernel = collections.Counter(), collections.Counter()
    for name, dur, _, module in events:
        by_module[module or "?"] += dur
        by_kernel[name] += dur
    per = 1e3 * rounds
    out = {"traced_wall_ms_per_round": 1e3 * traced / rounds, "busy_ms_per_round": busy / per,
           "idle_ms_per_round": idle / per,
           "busy_ms_per_round_by_module": {k: round(v / per, 4) for k, v in by_module.most_common(top)},
           "busy_ms_per_round_by_kernel": {k[:80]: round(v / per, 4) for k, v in by_kernel.most_common(top)}}
    print(f"\ndevice, traced run: busy {out['busy_ms_per_round']:.3f} ms, idle {out['idle_ms_per_round']:.3f} ms per "
          f"round (traced wall {out['traced_wall_ms_per_round']:.3f})")
    for title, table in (("module", out["busy_ms_per_round_by_module"]), ("kernel", out["busy_ms_per_round_by_kernel"])):
        print(f"\n{'busy ms per round by ' + title:<84} {'ms':>8}")
        for k, v in table.items():
            print(f"{k[:84]:<84} {v:>8.4f}")
    return out


if __name__ == "__main__":
    main()
