"""Device time of the draft's softmax + top-K: XLA's path, the `softmax_topk` kernel, and diagnostic
cut-down kernels (what a row's load, its max, its sum of exponentials and the k argmax passes each
cost), per call, from a profiler trace (kernel durations; no loop overhead).

    python bench/probes/topk.py --rows 4,192 --vocab 8192 --k 4
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_events_by_device, device_kind, git_commit  # noqa: E402

CALLS = 16


def cut_kernel(x_ref, o_ref, *, stage, k, kp):
    """stage 0: load + max; 1: + sum of exp; 2: + k argmax passes over int32 keys (no gather)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    r = pl.program_id(0)
    x = x_ref[r, :].astype(jnp.float32)
    m = jnp.max(x)
    out = jnp.zeros((kp,), jnp.float32) + m
    if stage >= 1:
        out = out + jnp.sum(jnp.exp(x - m))
    if stage >= 2:
        lane = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0)
        base = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        bits = jax.lax.bitcast_convert_type(x, jnp.int32)
        key = jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        for j in range(k):
            a = jnp.argmax(key).astype(jnp.int32)
            out = jnp.where(lane == j, a.astype(jnp.float32), out)
            key = jnp.where(base == a, -(2**31), key)
    o_ref[0, :] = out


def cut(x, k, stage, warps, interpret=False):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r, _ = x.shape
    kp = 16
    return pl.pallas_call(functools.partial(cut_kernel, stage=stage, k=k, kp=kp), grid=(r,),
                          in_specs=[pl.no_block_spec], out_specs=pl.BlockSpec((1, kp), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((r, kp), jnp.float32),
                          compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
                          interpret=interpret, name=f"cut{stage}_w{warps}")(x)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="4,192")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--warps", default="4,8,16", help="the cut-down kernels' warps (empty: none)")
    p.add_argument("--backend", default="pallas", help="interpret: a CPU check of the script")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jeagle.kernels.settings import KernelSettings, use
    from jeagle.kernels.topk import softmax_topk, softmax_topk_reference

    variants = {"xla": lambda x: softmax_topk_reference(x, args.k)[0],
                "kernel": lambda x: softmax_topk(x, args.k)[0]}
    warps = [int(v) for v in args.warps.split(",") if v.strip()]
    if warps and args.vocab & (args.vocab - 1):  # the cut-down kernels hold the row unpadded: Triton wants 2^n
        print(f"--vocab {args.vocab} is not a power of two: the cut-down kernels are skipped", flush=True)
        warps = []
    for w in warps:
        for stage in (0, 1, 2):
            variants[f"cut{stage}_w{w}"] = functools.partial(
                lambda x, s, w: cut(x, args.k, s, w, args.backend == "interpret"), s=stage, w=w)
    rows_out = []
    for rows in (int(v) for v in args.rows.split(",")):
        xs = jnp.asarray(np.random.default_rng(0).normal(size=(CALLS, rows, args.vocab)), jnp.float32)
        for name, fn in variants.items():
            with use(KernelSettings(backend=args.backend)):
                f = jax.jit(lambda xs, fn=fn: sum(jnp.sum(fn(xs[i])) for i in range(CALLS)))
                f(xs).block_until_ready()
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d):
                    f(xs).block_until_ready()
                events = [e for evs in device_events_by_device(d).values() for e in evs]
            by = collections.Counter()
            for ev_name, dur in events:
                by[ev_name] += dur
            total = sum(by.values()) / CALLS
            top = {k: round(v / CALLS, 2) for k, v in by.most_common(4)}
            print(f"rows {rows:4d} {name:12s} {total:8.2f} us/call   {top}", flush=True)
            rows_out.append({"rows": rows, "variant": name, "us_per_call": round(total, 2), "top": top})
    print(json.dumps({"bench": "topk_probe", "device": device_kind(), "commit": git_commit(), "vocab": args.vocab,
                      "k": args.k, "rows": rows_out}))


if __name__ == "__main__":
    main()
