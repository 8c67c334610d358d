"""Would pages pay for the paged-attention kernel? (Page size > 1 only if measurement
shows it pays.) The kernel reads a request's prefix through its slot-table row, one slot per
position; pages would give it runs of consecutive slots. This times the kernel over the same prefix
lengths with three layouts of the same pool:

  contiguous  each request's positions in one run of consecutive slots (any page size's best case)
  pages16     runs of 16 consecutive slots, the runs in random order over the pool (page size 16)
  scattered   every position in a random slot of the pool (the worst a page-size-1 pool can get; the
              engine's allocator hands out runs of a chunk (64) or more, between these two)

Forms: `decode` (one query a request, the prefix plus one extra key: a decode step), `verify`
(9 queries, 9 extra keys: a (5,4,8) tree's verify), `prefill` (the causal form, 64 new positions after
the prefix: a prefill after a prefix-cache hit). Time per call: one executable runs the kernel over
every layer of the pool, the layers unrolled, its median wall over `--samples` runs ÷ layers.
(The 2026-11-27 numbers in bench/RESULTS.md ran the layers in a `fori_loop`, whose per-trip overhead on a GPU dominates the
small cases: there only rows of ≥ ~30 µs a call say something about the layout.)

    python bench/probes/page_layout.py --shapes smollm2,llama8b --batch-sizes 1,16,48 --prefix 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import SHAPES, device_kind, emit, git_commit  # noqa: E402

LAYOUTS = ("contiguous", "pages16", "scattered")


def slot_table(layout: str, b: int, s: int, num_slots: int, rng):
    """[b, s] slots of the pool's first num_slots - 1 (the last is the extra keys' scratch)."""
    import numpy as np

    if layout == "contiguous":
        return np.arange(b * s, dtype=np.int32).reshape(b, s)
    if layout == "pages16":
        pages = rng.permutation((num_slots - 1) // 16)[: b * s // 16]
        return (pages[:, None] * 16 + np.arange(16)).reshape(b, s).astype(np.int32)
    return rng.permutation(num_slots - 1)[: b * s].reshape(b, s).astype(np.int32)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2,llama8b")
    p.add_argument("--batch-sizes", default="1,16,48")
    p.add_argument("--prefix", type=int, default=1024, help="cached positions per request")
    p.add_argument("--forms", default="decode,verify,prefill")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jeagle.kernels.paged_attention import paged_attention

    rng = np.random.default_rng(0)
    doc = {"bench": "page_layout", "device": device_kind(), "commit": git_commit(), "prefix": args.prefix, "rows": []}
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        layers, hkv, hq, d = cfg["num_layers"], cfg["num_kv_heads"], cfg["num_heads"], cfg["head_dim"]
        batches = [int(x) for x in args.batch_sizes.split(",")]
        s = args.prefix
        num_slots = max(batches) * (s + 64) * 2 + 1
        pool = jax.random.normal(jax.random.PRNGKey(0), (layers, num_slots, hkv, d), jnp.bfloat16)
        for b in batches:
            for form in args.forms.split(","):
                t = {"decode": 1, "verify": 9, "prefill": 64}[form]
                q = jax.random.normal(jax.random.PRNGKey(b), (b, t, hq, d), jnp.bfloat16)
                kv_len = jnp.full((b,), s + (t if form == "prefill" else 0), jnp.int32)
                base = {}
                for layout in LAYOUTS:
                    width = s + (t if form == "prefill" else 0)
                    table = jnp.asarray(slot_table(layout, b, -(-width // 16) * 16, num_slots, rng)[:, :width])
                    if form == "prefill":
                        pos = jnp.asarray(np.arange(s, s + t)[None].repeat(b, 0), jnp.int32)
                        extra = {"positions": pos}
                    else:
                        extra = {"extra_slots": jnp.full((b, t), num_slots - 1, jnp.int32),
                                 "extra_mask": jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))}

                    def run(q, pool, table, kv_len, extra=extra):
                        acc = jnp.float32(0)
                        for i in range(layers):  # unrolled: a GPU while loop reads its predicate back each trip
                            out = paged_attention(q, pool, pool, i, table, kv_len, **extra)
                            acc = acc + out[:, :1, :1, :1].astype(jnp.float32).sum()
                        return acc

                    f = jax.jit(run).lower(q, pool, table, kv_len).compile()
                    f(q, pool, table, kv_len).block_until_ready()
                    times = []
                    for _ in range(args.samples):
                        t0 = time.perf_counter()
                        f(q, pool, table, kv_len).block_until_ready()
                        times.append(time.perf_counter() - t0)
                    us = statistics.median(times) / layers * 1e6
                    base.setdefault("contiguous", us)
                    row = {"shape": shape, "batch": b, "form": form, "queries": t, "layout": layout,
                           "us_per_layer": round(us, 2), "vs_contiguous": round(us / base["contiguous"], 3)}
                    doc["rows"].append(row)
                    print(json.dumps(row), flush=True)
        del pool
    emit(doc, args.json_out)
    return doc


if __name__ == "__main__":
    main()
