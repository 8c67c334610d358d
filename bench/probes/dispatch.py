"""Host cost of dispatching one speculative round, vs its chained time.

Random SmolLM2-shaped target and EAGLE-1 head, tier 5,4,8, warm. Per batch size:
  dispatch ms   host time for one call of the round executable to return, the GPU idle before it
                (what the host pays per round before it can do anything else)
  chained ms    per round, `--reps` rounds dispatched back to back and one wait at the end: the
                larger of the device time and the dispatch time
  trace ms      device-busy time per round from a jax.profiler trace of the chained rounds
Run it under different XLA_FLAGS / JEAGLE_XLA_OPTIONS, or with --unroll all (layers unrolled: no while
loop in the executable) or --unroll k (k layers per loop iteration), to see what the launch path costs. Prints a table, then one JSON line.

    python bench/probes/dispatch.py --batch-sizes 1,16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_events, device_kind, git_commit, random_target_and_head  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--unroll", default="0", help="layer loop: 0 (a loop), k (k layers per iteration) or all")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from jeagle.engine import EngineConfig, speculative
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig

    model, head = random_target_and_head(args.shape)
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        unroll = True if args.unroll == "all" else int(args.unroll)
        eng = speculative(model, head, EngineConfig(max_batch_size=b, max_context=1024, batch_buckets=(b,),
                                                    unroll_layers=unroll, kernels=KernelSettings.from_env()),
                          SpecConfig(5, 4, 8))
        t0 = time.perf_counter()
        eng.generate([list(range(100, 356))] * b, SamplingParams(max_new_tokens=32, ignore_eos=True))
        compile_s = time.perf_counter() - t0
        row_ids = np.arange(b, dtype=np.int32)
        dec = eng.decoder  # the speculative decoder: its params, its donated device state, the active tier
        exe = eng.executables.get(dec.round_key(dec.spec, b, eng.buckets.kv[0], True))

        def call():
            res, dec.state = exe(dec.param_leaves, dec.state, row_ids)
            return res

        jax.block_until_ready(call())
        disp = []
        for _ in range(20):
            jax.block_until_ready(dec.state)
            t0 = time.perf_counter()
            res = call()
            disp.append(time.perf_counter() - t0)
            jax.block_until_ready(res)

        def chained(n):
            t0 = time.perf_counter()
            for _ in range(n):
                res = call()
            jax.block_until_ready(res)
            return time.perf_counter() - t0

        chained(3)
        chain_ms = 1e3 * (chained(args.reps + 1) - chained(1)) / args.reps
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                chained(10)
            ev = device_events(d)
        row = {"batch": b, "unroll": args.unroll, "dispatch_ms": 1e3 * float(np.median(disp)),
               "chained_ms": chain_ms, "trace_busy_ms": sum(x for _, x in ev) / 1e3 / 10,
               "device_ops_per_round": len(ev) / 10, "warm_compile_s": round(compile_s, 1)}
        rows.append(row)
    flags = os.environ.get("XLA_FLAGS", "") + " " + os.environ.get("JEAGLE_XLA_OPTIONS", "")
    print(f"flags: {flags.strip() or 'default'}, layer unroll {args.unroll}")
    print(f"{'batch':>5} {'dispatch ms':>11} {'chained ms':>10} {'trace busy ms':>13} {'ops/round':>9} {'compile s':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['dispatch_ms']:>11.3f} {r['chained_ms']:>10.3f} {r['trace_busy_ms']:>13.3f} "
              f"{r['device_ops_per_round']:>9.0f} {r['warm_compile_s']:>9.1f}")
    print(json.dumps({"bench": "dispatch", "shape": args.shape, "device": device_kind(),
                      "commit": git_commit(), "flags": flags.strip(), "rows": rows}))


if __name__ == "__main__":
    main()
