"""Each Pallas kernel vs its pure-jnp reference, both compiled by XLA, on the GPU.

Kernels and inputs (random valid inputs from tests/kernels/trees.py):
  verify_tree_greedy, tree_speculative_sampling (V = 49,152, SmolLM2's vocabulary; probabilities
  drawn on the device), build_tree (drafts of K = 4 expanded until N-1 nodes exist), commit_slots
  (req_to_token rows of 4,096 positions), assign_req_to_token_pool (about 1,000 slots per request),
at B ∈ {1, 8, 64, 256} and N ∈ {4, 8, 64} (N does not apply to assign_req_to_token_pool).

Timing: one sample = `--calls` back-to-back calls of the jitted function, then `block_until_ready`,
divided by `--calls` (dispatch is pipelined, so a sample is device time unless the host is slower);
the median of `--samples` samples after a warm-up. Prints a table, then one JSON line.

    python bench/kernels.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 49152


def median_us(fn, args, samples, calls):
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    times.sort()
    return 1e6 * times[len(times) // 2]


def cases(b, n):
    """(kernel name, reference fn, pallas fn, args) for one (B, N)."""
    import jax
    import jax.numpy as jnp

    from jeagle.kernels import build_tree as bt
    from jeagle.kernels import commit_slots as cs
    from jeagle.kernels import tree_speculative_sampling as tss
    from jeagle.kernels import verify_tree_greedy as vtg
    from tests.kernels.test_slots import commit_inputs
    from tests.kernels.trees import random_drafts, random_trees

    k = 4 if n > 4 else 2
    tree_args, steps = random_trees(b, n, k, seed=b + n)
    steps = min(steps, 8)
    yield ("verify_tree_greedy", functools.partial(vtg.verify_tree_greedy_reference, num_spec_steps=steps),
           functools.partial(vtg._pallas, num_spec_steps=steps, interpret=False), tree_args)

    key = jax.random.key(b * 100 + n)
    logits = jax.random.normal(key, (b, n, VOCAB), jnp.float32) * 3
    cand = tree_args[0]
    boost = jnp.zeros((b, n, VOCAB)).at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None],
                                         jnp.maximum(cand, 0)[:, None, :]].set(8.0)
    probs = jax.nn.softmax(logits + boost, -1)
    coins = jax.random.uniform(jax.random.fold_in(key, 1), (b, n))
    final = jax.random.uniform(jax.random.fold_in(key, 2), (b,))
    yield ("tree_speculative_sampling",
           functools.partial(tss.tree_speculative_sampling_reference, num_spec_steps=steps),
           functools.partial(tss._pallas, num_spec_steps=steps, interpret=False),
           tree_args[:4] + (probs, coins, final))

    draft_args, depth = random_drafts(b, n, 4, seed=b + n)
    yield ("build_tree", functools.partial(bt.build_tree_reference, max_depth=depth),
           functools.partial(bt._pallas, max_depth=depth, interpret=False), draft_args)

    yield ("commit_slots", cs.commit_slots_reference, functools.partial(cs._pallas, interpret=False),
           commit_inputs(b, n, seed=b + n, s1=min(steps, 6), c=4096))


def assign_case(b):
    import jax.numpy as jnp
    import numpy as np

    from jeagle.kernels import assign_req_to_token_pool as arp

    rng = np.random.default_rng(b)
    rt = jnp.asarray(rng.integers(0, 1000, (b + 2, 4096)), jnp.int32)
    count = rng.integers(800, 1200, b)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    args = (rt, i32(np.arange(b)), i32(np.zeros(b)), i32(count), i32(rng.integers(1, 10**6, int(count.sum()))))
    return ("assign_req_to_token_pool", arp.assign_req_to_token_pool_reference,
            functools.partial(arp._pallas, interpret=False), args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--nodes", default="4,8,64")
    args = p.parse_args(argv)

    import jax

    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        todo = [(n, c) for n in [int(x) for x in args.nodes.split(",")] for c in cases(b, n)] + [(None, assign_case(b))]
        for n, (name, ref, ker, kargs) in todo:
            r_us = median_us(jax.jit(ref), kargs, args.samples, args.calls)
            k_us = median_us(jax.jit(ker), kargs, args.samples, args.calls)
            rows.append({"kernel": name, "B": b, "N": n, "reference_us": round(r_us, 1), "pallas_us": round(k_us, 1),
                         "speedup": round(r_us / k_us, 2)})
            print(f"{name:<26} {b:>4} {str(n or '-'):>4} {r_us:>10.1f} {k_us:>10.1f} {r_us / k_us:>8.2f}", flush=True)
    print(json.dumps({"bench": "kernels", "device": jax.devices()[0].device_kind, "vocab": VOCAB,
                      "commit": os.environ.get("JEAGLE_COMMIT", "unknown"), "rows": rows}))


if __name__ == "__main__":
    main()
