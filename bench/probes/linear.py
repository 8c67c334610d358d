"""The skinny-matmul kernel (jeagle/kernels/linear.py) against XLA's dot, per tile choice, on the GPU.

For SmolLM2's four layer matmuls (q|k|v 576x960, output 576x576, gate|up 576x3072, down 1536x576; or
the Llama-3.1-8B shape's with `--shape llama8b`) at
M rows, a jitted loop runs `--layers` x `--chains` matmuls in a row, each reading its layer of a
stacked [L, K, N] bf16 weight at a traced index and feeding the next (x += 1e-3 * a row-sum of y: one
small fusion per matmul, the same for every variant). Prints us per matmul (median of `--samples`
runs, the loop's dispatch amortised over all its matmuls) for XLA's dot (`x @ w[i]`, what the
models did before the kernel), the kernel's default tiles and every (N block, K splits) of a grid,
then one JSON line.

    python bench/probes/linear.py --rows 1,8,48
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import device_kind, emit  # noqa: E402

SHAPES = {"smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)},
          "llama8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,8,48")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--chains", type=int, default=8)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--grid", default="16,32,64,128/1,2,4,8", help="N blocks / K splits tried")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jeagle.kernels import linear as lin
    from jeagle.kernels.settings import KernelSettings, use

    bns, splits = ([int(v) for v in part.split(",")] for part in args.grid.split("/"))
    out = {"bench": "linear_probe", "shape": args.shape, "device": device_kind(), "rows": []}
    steps = args.layers * args.chains

    def timed(mm, x, w):
        def run(x, w):
            def body(i, x):
                y = mm(x, w, i % args.layers)
                return x + (1e-3 * jnp.sum(y.astype(jnp.float32), -1, keepdims=True)).astype(x.dtype)
            return jax.lax.fori_loop(0, steps, body, x)

        f = jax.jit(run)
        jax.block_until_ready(f(x, w))
        ts = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, w))
            ts.append(time.perf_counter() - t0)
        return 1e6 * sorted(ts)[len(ts) // 2] / steps

    rng = np.random.default_rng(0)
    with use(KernelSettings(backend="pallas")):
        for m in [int(v) for v in args.rows.split(",")]:
            for name, (k, n) in SHAPES[args.shape].items():
                x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
                w = jnp.asarray(rng.normal(size=(args.layers, k, n)) / np.sqrt(k), jnp.bfloat16)
                row = {"m": m, "name": name, "k": k, "n": n, "default_tiles": lin.linear_tiles(m, k, n)}
                row["xla_us"] = timed(lambda x, w, i: x @ w[i], x, w)
                row["default_us"] = timed(lambda x, w, i: lin.linear(x, w, i), x, w)
                mp, bk, _, _ = lin.linear_tiles(m, k, n)
                grid = {}
                for bn in bns:
                    for s in splits:
                        if n % bn or s > k // bk:
                            continue
                        tiles = (mp, bk, bn, s)
                        grid[f"{bn}/{s}"] = timed(lambda x, w, i, t=tiles: lin.linear(x, w, i, tiles=t), x, w)
                row["grid_us"] = grid
                best = min(grid, key=grid.get)
                print(f"m={m:<3} {name:<8} xla {row['xla_us']:6.2f}  default {row['default_tiles']} "
                      f"{row['default_us']:6.2f}  best {best} {grid[best]:6.2f}  "
                      + " ".join(f"{key}:{v:.2f}" for key, v in grid.items()), flush=True)
                out["rows"].append(row)
    emit(out)


if __name__ == "__main__":
    main()
