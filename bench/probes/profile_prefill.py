"""Where a prefill's time goes: wall time of the (speculative) prefill executable per batch bucket and
a `jax.profiler` trace summarised by device op.

Random SmolLM2-shaped target and EAGLE-1 head, `--context`-token prompts, warm (compiled before
timing). Per batch size: wall ms of one prefill call (dispatch to result on the host), device-busy ms
in the trace, and the top device ops. Prints a table, then one JSON line.

    python bench/probes/profile_prefill.py --batch-sizes 1,4,16 --context 128
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_events, device_kind, git_commit, random_target_and_head  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--target-only", action="store_true", help="the autoregressive engine's prefill")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig

    model, head = random_target_and_head(args.shape)
    rng = np.random.default_rng(0)
    out = {"bench": "profile_prefill", "shape": args.shape, "device": device_kind(),
           "commit": git_commit(), "rows": []}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        cfg = EngineConfig(max_batch_size=batch, max_context=args.context + 600, batch_buckets=(batch,),
                           kernels=KernelSettings.from_env())
        eng = target_only(model, cfg) if args.target_only else speculative(model, head, cfg, SpecConfig(5, 4, 8))
        prompts = [list(rng.integers(10, model.cfg.vocab_size, args.context)) for _ in range(batch)]

        def prefill():
            # What the scheduler does for one prefill group, by hand: checked requests, a row and the
            # prompt's slots for each (no cached prefix), the (batch, length) bucket, the decoder's dispatch.
            dec = eng.decoder
            reqs = [eng.check(pr, SamplingParams(max_new_tokens=512, ignore_eos=True), i)
                    for i, pr in enumerate(prompts)]
            for r in reqs:
                lay = dec.layout
                assert eng.kv.admit(r, len(r.prompt), lay.tree + lay.scratch), "the pool has no room for the batch"
            t0 = time.perf_counter()
            b, t = eng.buckets.prefill(len(reqs), max(len(r.prompt) for r in reqs))
            res = dec.prefill(reqs, b, t)
            np.asarray(res)
            dt = time.perf_counter() - t0
            for r in reqs:
                eng.kv.release(r)
            return dt

        prefill()  # compile
        walls = [prefill() for _ in range(args.reps)]
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                prefill()
            ev = device_events(d)
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for name, dur in ev:
            by_name[name][0] += 1
            by_name[name][1] += dur
        row = {"batch": batch, "context": args.context, "wall_ms": 1e3 * float(np.median(walls)),
               "device_busy_ms": sum(d for _, d in ev) / 1e3, "device_ops": len(ev),
               "top": sorted(((n, c, t / 1e3) for n, (c, t) in by_name.items()), key=lambda x: -x[2])[: args.top]}
        out["rows"].append(row)
        print(f"\nbatch {batch} x {args.context}: wall {row['wall_ms']:.2f} ms, device busy {row['device_busy_ms']:.2f} ms, "
              f"{row['device_ops']} device ops")
        print(f"{'op':<80} {'count':>6} {'ms':>9}")
        for n, c, t in row["top"]:
            print(f"{n[:80]:<80} {c:>6} {t:>9.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
