"""The adaptive throughput policy's host time per verify, no device: `ThroughputPolicy.update`
fed `--verifies` synthetic verifies of `--batch` requests at (5,4,8) with the would-be accept lengths of
the two tiers it nests, and a `RoundTimes` with every tier calibrated; prints µs per verify, then (with
`--profile`) the top functions by own time.

    python bench/probes/policy_host.py --batch 16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--verifies", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--lists", action="store_true", help="Python lists, as the decoder passed them before fda1eb0")
    p.add_argument("--update-interval", type=int, default=None, help="default: the policy's")
    args = p.parse_args(argv)

    import numpy as np

    from jeagle.speculative.adaptive import AdaptiveConfig
    from jeagle.speculative.adaptive_throughput import RoundTimes, ThroughputPolicy

    tiers = [(1, 4, 3), (3, 4, 5), (5, 4, 8), (7, 4, 11)]
    cfg = AdaptiveConfig.from_dict({"policy": "throughput", "candidate_tiers": [list(t) for t in tiers]}
                                   | ({} if args.update_interval is None else {"update_interval": args.update_interval}))
    pol, times, bucket = ThroughputPolicy(cfg, tiers, 2), RoundTimes(), (args.batch, 512, True)
    for j in range(len(tiers)):
        times.calibrated(j, bucket, 1.4 + 0.1 * j)
    rng = np.random.default_rng(0)
    # As the decoder passes them: int arrays (lists before `fda1eb0`: `--lists`).
    acc = [rng.integers(0, 5, args.batch) for _ in range(args.verifies)]
    nest = [rng.integers(0, 4, (args.batch, 2)) for _ in range(args.verifies)]
    if args.lists:
        acc, nest = [a.tolist() for a in acc], [w.tolist() for w in nest]

    def run():
        for a, w in zip(acc, nest):
            times.observed(2, bucket, 1.5)
            pol.update(a, 2, lambda j: times.estimate(j, bucket), w)

    t0 = time.perf_counter()
    run()
    print(f"batch {args.batch}, update_interval {cfg.update_interval}{', lists' if args.lists else ''}: "
          f"{(time.perf_counter() - t0) / args.verifies * 1e6:.1f} µs per verify (active tier {tiers[pol.index]})")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(run)
        pstats.Stats(prof).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
