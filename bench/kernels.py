"""Each Pallas kernel vs its pure-jnp reference, both compiled by XLA, on the GPU.

Random valid trees (tests/kernels/trees.py) at B ∈ {1, 8, 64, 256} and N ∈ {4, 8, 64}; median of
`--iters` timed calls after warm-up, each call `block_until_ready`. Prints a table, then one JSON line.

    python bench/kernels.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_us(fn, args, iters):
    out = fn(*args)
    jax_block(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax_block(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e6 * times[len(times) // 2]


def jax_block(x):
    import jax

    jax.block_until_ready(x)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)

    import functools

    import jax

    from jeagle.kernels import verify_tree_greedy as vtg
    from tests.kernels.trees import random_trees

    rows = []
    for b in (1, 8, 64, 256):
        for n in (4, 8, 64):
            tree_args, steps = random_trees(b, n, 4 if n > 4 else 2, seed=b + n)
            steps = min(steps, 8)
            ref = jax.jit(functools.partial(vtg.verify_tree_greedy_reference, num_spec_steps=steps))
            ker = jax.jit(functools.partial(vtg._pallas, num_spec_steps=steps, interpret=False))
            r_us, k_us = median_us(ref, tree_args, args.iters), median_us(ker, tree_args, args.iters)
            rows.append({"kernel": "verify_tree_greedy", "B": b, "N": n, "steps": steps, "reference_us": round(r_us, 1),
                         "pallas_us": round(k_us, 1), "speedup": round(r_us / k_us, 2)})
    print(f"{'kernel':<20} {'B':>4} {'N':>4} {'ref us':>8} {'pallas us':>10} {'speed-up':>8}")
    for r in rows:
        print(f"{r['kernel']:<20} {r['B']:>4} {r['N']:>4} {r['reference_us']:>8.1f} {r['pallas_us']:>10.1f} {r['speedup']:>8.2f}")
    print(json.dumps({"bench": "kernels", "device": jax.devices()[0].device_kind,
                      "commit": os.environ.get("JEAGLE_COMMIT", "unknown"), "rows": rows}))


if __name__ == "__main__":
    main()
