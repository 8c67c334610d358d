"""Each Pallas kernel vs its pure-jnp reference, both compiled by XLA, on the GPU.

Kernels and inputs (random valid inputs from tests/kernels/trees.py):
  verify_tree_greedy, tree_speculative_sampling (V = 49,152, SmolLM2's vocabulary; probabilities
  drawn on the device), build_tree (drafts of K = 4 expanded until N-1 nodes exist), commit_slots
  (req_to_token rows of 4,096 positions), assign_req_to_token_pool (about 1,000 slots per request),
at B ∈ {1, 8, 64, 256} and N ∈ {4, 8, 64} (N does not apply to assign_req_to_token_pool).

Timing: device time per call, from one executable holding `--reps` data-dependent calls against one
holding a single call (median of `--samples` executions each, after warm-up), so the ~70-100 us
of dispatch that a lone jitted call costs on the runner cancels out. Prints a table, then one JSON
line.

    python bench/probes/kernels.py
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, git_commit  # noqa: E402

VOCAB = 49152
INTERPRET = False  # --interpret: a CPU smoke run of this script, timings meaningless


def median_s(fn, args, samples):
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def chained(fn, reps):
    """`reps` calls of fn in one executable, each call's first input depending on the previous call's
    output through a zero XLA cannot see (x >> 31 of a non-negative sum of all its outputs), so none is hoisted or
    overlapped; req_to_token-updating kernels chain through their output directly."""
    import jax
    import jax.numpy as jnp

    def run(*args):
        first, dep, out = args[0], jnp.int32(0), None
        for _ in range(reps):
            out = fn(first + (dep >> 31).astype(first.dtype), *args[1:])
            leaf = jax.tree.leaves(out)[0]
            if leaf.shape == first.shape and leaf.dtype == first.dtype:
                first = leaf
            dep = sum(jnp.abs(x.astype(jnp.int32)).sum() for x in jax.tree.leaves(out))  # every output is live
        return out

    return jax.jit(run)


def device_us(fn, args, samples, reps):
    """Per-call device time: (time of `reps` chained calls - time of 1) / (reps - 1), medians of
    `samples` timed executions after warm-up, so dispatch and launch of the executable cancel."""
    one, many = median_s(chained(fn, 1), args, samples), median_s(chained(fn, reps), args, samples)
    return 1e6 * max(many - one, 0.0) / (reps - 1)


def cases(b, n):
    """(kernel name, reference fn, pallas fn, args) for one (B, N)."""
    import jax
    import jax.numpy as jnp

    from jeagle.kernels import build_tree as bt
    from jeagle.kernels import commit_slots as cs
    from jeagle.kernels import tree_speculative_sampling as tss
    from jeagle.kernels import verify_tree_greedy as vtg
    from tests.kernels.trees import commit_inputs, random_drafts, random_trees

    k = 4 if n > 4 else 2
    tree_args, steps = random_trees(b, n, k, seed=b + n)
    steps = min(steps, 8)
    yield ("verify_tree_greedy", functools.partial(vtg.verify_tree_greedy_reference, num_spec_steps=steps),
           functools.partial(vtg._pallas, num_spec_steps=steps, interpret=INTERPRET), tree_args)

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
           functools.partial(tss._pallas, num_spec_steps=steps, interpret=INTERPRET),
           tree_args[:4] + (probs, coins, final))

    draft_args, depth = random_drafts(b, n, 4, seed=b + n)
    yield ("build_tree", functools.partial(bt.build_tree_reference, max_depth=depth),
           functools.partial(bt._pallas, max_depth=depth, interpret=INTERPRET), draft_args)

    yield ("commit_slots", cs.commit_slots_reference, functools.partial(cs._pallas, interpret=INTERPRET),
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
            functools.partial(arp._pallas, interpret=INTERPRET), args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--nodes", default="4,8,64")
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    p.add_argument("--interpret", action="store_true", help="run the kernels interpreted (CPU smoke test only)")
    args = p.parse_args(argv)
    global INTERPRET
    INTERPRET = args.interpret

    import jax

    print(f"{'kernel':<26} {'B':>4} {'N':>4} {'ref us':>10} {'pallas us':>10} {'speedup':>8}")
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        todo = [(n, c) for n in [int(x) for x in args.nodes.split(",")] for c in cases(b, n)] + [(None, assign_case(b))]
        for n, (name, ref, ker, kargs) in todo:
            if args.kernels and name not in args.kernels.split(","):
                continue
            r_us = device_us(ref, kargs, args.samples, args.reps)
            k_us = device_us(ker, kargs, args.samples, args.reps)
            rows.append({"kernel": name, "B": b, "N": n, "reference_us": round(r_us, 1), "pallas_us": round(k_us, 1),
                         "speedup": round(r_us / max(k_us, 0.1), 2)})
            print(f"{name:<26} {b:>4} {str(n or '-'):>4} {r_us:>10.1f} {k_us:>10.1f} {r_us / max(k_us, 0.1):>8.2f}",
                  flush=True)
    print(json.dumps({"bench": "kernels", "device": device_kind(), "vocab": VOCAB,
                      "commit": git_commit(), "rows": rows}))


if __name__ == "__main__":
    main()
