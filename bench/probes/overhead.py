"""Host overhead per speculative round: host-blocked time and GPU idle share, for the runtime modes.

Modes: `no-overlap` (the host processes round r before dispatching r+1, hard wait), `overlap+sync`
(round r+1 dispatched before round r is processed, but the next host step starts with a hard wait on
round r's verify results: SGLang's default) and `overlap+dataflow` (no hard wait; rounds depend on
each other through device data only). Random SmolLM2-shaped weights and a random EAGLE-1 head
(acceptance does not change a round's cost), greedy, 256-token prompts, warm.

Per mode and batch size:
  wall ms / round       generate() wall time / rounds
  host-blocked ms       per round, time the host spent waiting on the device (verify_done wait +
                        reading results): mean, p50, p99
  device ms / round     the same round executable run back to back with no host work in between
                        (`--reps` chained calls, one wait), i.e. what the GPU needs
  GPU idle share        1 - device ms / wall ms
Prints a table, then one JSON line.

    python bench/probes/overhead.py --batch-sizes 1,16,48
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, git_commit, random_target_and_head  # noqa: E402

MODES = {"no-overlap": (False, "sync"), "overlap+sync": (True, "sync"), "overlap+dataflow": (True, "dataflow")}


def device_round_ms(engine, b, kv, reps):
    """Device time of one round: `reps` rounds of the compiled executable over the rows the finished
    generation left behind (distinct rows and slots, as in serving; finished, so nothing commits),
    chained through the donated state, dispatched back to back, one wait at the end. (Padding rows
    would all write the scratch slot, and that scatter contention is not what a real round costs.)"""
    import jax
    import numpy as np

    dec = engine.decoder  # the speculative decoder: its params, its donated device state, the active tier
    row_ids = (np.arange(b) % engine.max_running).astype(np.int32)
    exe = engine.executables.get(dec.round_key(dec.spec, b, kv, True))

    def run(n):
        t0 = time.perf_counter()
        res = None
        for _ in range(n):
            res, dec.state = exe(dec.param_leaves, dec.state, row_ids)
        jax.block_until_ready(res)
        return time.perf_counter() - t0

    run(2)
    return 1e3 * (run(reps + 1) - run(1)) / reps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--batch-sizes", default="1,16,48")
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--rounds", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=32)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--distinct", action="store_true",
                   help="a different prompt per row (default: one prompt repeated, which the prefix cache shares)")
    p.add_argument("--engine-config", default="{}", metavar="JSON",
                   help='more EngineConfig fields, e.g. \'{"prefix_cache": false}\'')
    p.add_argument("--kv-chunk", type=int, default=None, help="positions a request's slots grow by ahead of need")
    args = p.parse_args(argv)

    import tempfile

    from jeagle.runtime.store import enable_compile_cache

    enable_compile_cache(tempfile.mkdtemp(prefix="jeagle-xla-"))  # the modes share executables: compile once
    import jax

    from jeagle.engine import EngineConfig, speculative
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig

    model, head = random_target_and_head(args.shape)
    kernels = KernelSettings.from_env()
    s, k, n = (int(x) for x in args.tier.split(","))
    extra = json.loads(args.engine_config)
    sp = SamplingParams(max_new_tokens=args.rounds, ignore_eos=True)
    rows = []
    print(f"{'batch':>5} {'mode':>17} {'wall ms':>9} {'blk mean':>8} {'blk p50':>8} {'blk p99':>8} {'device ms':>9} "
          f"{'idle':>6}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        device_ms = None
        for mode in args.modes.split(","):
            overlap, wait = MODES[mode]
            eng = speculative(model, head, EngineConfig(max_batch_size=batch, max_context=1024, overlap=overlap,
                                                        verify_done_wait=wait, kernels=kernels, **extra),
                              SpecConfig(s, k, n))
            if args.kv_chunk:
                eng.kv.chunk = args.kv_chunk
            starts = [100 + (i if args.distinct else 0) for i in range(batch)]
            prompts = [list(range(a, a + args.context)) for a in starts]
            eng.generate(prompts, sp)  # compiles
            eng.flush_cache()  # the timed run starts cold, as the first did (no prefix-cache hits)
            eng.generate(prompts, sp)
            st = eng.last_stats.to_dict()
            if st["compile_s"]:
                print(f"warning: the timed run compiled for {st['compile_s']:.2f} s", flush=True)
            wall_ms = 1e3 * st["wall_s"] / st["steps"]
            if device_ms is None:
                b, kv = eng.buckets.decode(batch, args.context + args.rounds + s + 1)  # kv capped at the context
                device_ms = device_round_ms(eng, b, kv, args.reps)
            hb = st["host_blocked_ms"]
            rows.append({"batch": batch, "mode": mode, "rounds": st["steps"], "compile_s": st["compile_s"],
                         "wall_ms_per_round": round(wall_ms, 3),
                         "host_blocked_ms": {k2: round(v, 3) for k2, v in hb.items()},
                         "host_blocked_share": round(hb["mean"] / wall_ms, 3), "device_ms_per_round": round(device_ms, 3),
                         "gpu_idle_share": round(max(0.0, 1 - device_ms / wall_ms), 3)})
            r = rows[-1]
            print(f"{batch:>5} {mode:>17} {wall_ms:>9.3f} {hb['mean']:>8.3f} {hb['p50']:>8.3f} {hb['p99']:>8.3f} "
                  f"{device_ms:>9.3f} {r['gpu_idle_share']:>6.1%}", flush=True)
    print(json.dumps({"bench": "overhead", "shape": args.shape, "tier": [s, k, n], "device": device_kind(),
                      "distinct": args.distinct, "engine_config": extra, "kv_chunk": args.kv_chunk,
                      "commit": git_commit(), "rows": rows}))


if __name__ == "__main__":
    main()
