"""The host's cost of admitting many requests into one running batch: generate() of N requests at once
with max_batch_size = N, a tiny random model on the CPU, target-only and speculative.

Every request is admitted by the first `_admit_waiting` calls (the pool holds every row's whole
context), so what grows with N beyond the steps' own work is admission's bookkeeping: before
`KVFlow`'s `AdmissionBooks`, each admitted request summed over every request admitted before it
(O(N^2) per refill). Prints, per (mode, N), the timed run's wall seconds (compile time excluded:
`Stats.wall_s`), the seconds spent in `_admit_waiting` (admission, and the prefills it dispatches),
the steps, then one JSON line per case. A warm-up run of the same workload compiles first
(`--no-warmup`: the one run is timed, its compile time still excluded).

Measured (2-core CPU; wall / admission seconds, defaults: prompts of 4-12 tokens, 8 new tokens each):

    N      target-only before   after         speculative before   after
    500     0.20 / 0.15          0.18 / 0.08   0.28 / 0.16          0.31 / 0.09
    2000    2.51 / 2.32          0.68 / 0.31   3.79 / 3.04          1.29 / 0.35
    8000   42.29 / 41.06         3.25 / 1.63  52.10 / 48.09         6.27 / 2.14

    JAX_PLATFORMS=cpu .venv/bin/python bench/probes/admission.py --n 500 2000 8000
    JAX_PLATFORMS=cpu .venv/bin/python bench/probes/admission.py --n 8000 --mode spec --profile 25
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

import common  # noqa: E402,F401


def run_case(mode: str, n: int, args) -> dict:
    import numpy as np

    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig
    from tests.spec_models import bigram_target, signed_identity_head, target_config

    target = bigram_target(target_config())
    cfg = EngineConfig(max_batch_size=n, max_context=args.context, batch_buckets=(n,) if args.one_bucket else None)
    if mode == "spec":
        engine = speculative(target, signed_identity_head(target, +1.0, noise=0.08), cfg, SpecConfig(3, 2, 5))
    else:
        engine = target_only(target, cfg)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(4, 96, int(rng.integers(4, args.prompt + 1))))) for _ in range(n)]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)

    admit_s = [0.0]
    inner = engine._admit_waiting

    def timed_admit():
        t0 = time.perf_counter()
        try:
            inner()
        finally:
            admit_s[0] += time.perf_counter() - t0
    engine._admit_waiting = timed_admit

    if not args.no_warmup:
        engine.generate(prompts, params)
        engine.flush_cache()
    admit_s[0] = 0.0
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    outs = engine.generate(prompts, params)
    if prof:
        prof.disable()
    total = time.perf_counter() - t0
    st = engine.last_stats
    assert all(len(o.token_ids) == args.tokens for o in outs)
    engine.check_kv()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return {"mode": mode, "n": n, "wall_s": round(st.wall_s, 3), "call_s": round(total, 3),
            "admit_s": round(admit_s[0], 3), "steps": st.steps, "compile_s": round(st.compile_s, 2),
            "new_tokens": st.new_tokens, "commit": common.git_commit()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[500, 2000, 8000], help="requests (= max_batch_size)")
    p.add_argument("--mode", nargs="+", default=["target", "spec"], choices=["target", "spec"])
    p.add_argument("--context", type=int, default=64, help="max_context")
    p.add_argument("--prompt", type=int, default=12, help="longest prompt (4..this tokens, random)")
    p.add_argument("--tokens", type=int, default=8, help="new tokens per request")
    p.add_argument("--one-bucket", action="store_true", help="batch_buckets=(N,): fewer compiles")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="TOP", help="cProfile the timed run, print TOP rows")
    args = p.parse_args(argv)
    rows = []
    for mode in args.mode:
        for n in args.n:
            row = run_case(mode, n, args)
            rows.append(row)
            print(f"{mode:6s} N={n:6d}  wall {row['wall_s']:8.3f} s  admission {row['admit_s']:8.3f} s  "
                  f"steps {row['steps']:4d}  (compile {row['compile_s']:.1f} s)", flush=True)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
