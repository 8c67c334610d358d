"""Issue 22: would per-layer weight arrays cut a verify forward's host time? (bench/HISTORY.md session 27's question)

At batch 16 and 48 a SmolLM2 round call costs the host 0.96 / 1.13 ms (H200, session 37), most of it
XLA's per-thunk work for the verify's cuBLAS GEMMs on dynamic slices of the stacked [L, ...] weights
(dynamic-slice fusions: a prepare, an initialize and a forced command-buffer update every call). Weights
passed as one array per layer need no slice, but the call then takes ~6 x L arguments, and every
argument has a host cost of its own. This probe measures the trade on the layers' matmuls alone: a
SmolLM2-shaped stack (RMSNorm, q|k|v, an output projection of the q columns, SwiGLU MLP; no attention,
which reads the pool either way) over M rows, compiled ahead of time in three forms:

    loop      stacked weights, `lax.fori_loop` over the layers (a traced layer index)
    unrolled  stacked weights, every layer inline (a static slice per layer: the engine's unroll_layers)
    split     one array per layer and weight, every layer inline (no slice)

and calls each `--calls` times, each call's input the last call's output (so the calls queue on the
device in order), printing the median host ms of the call itself and the wall ms per call. The three
forms' outputs agree (checked once). CPU runs check the code only.

    python bench/probes/split_weights.py --rows 128,384 --calls 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import SHAPES, device_kind, git_commit  # noqa: E402

WEIGHTS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")
FORMS = ("loop", "unrolled", "split")


def random_weights(shape: dict, layers: int, seed: int = 0):
    """Stacked [L, ...] bf16 weights of a model shape's layer matmuls (q|k|v fused, gate|up fused)."""
    import jax
    import jax.numpy as jnp

    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_heads"] * d, shape["num_kv_heads"] * d
    dims = {"attn_norm": (h,), "wqkv": (h, q + 2 * kv), "wo": (q, h), "mlp_norm": (h,),
            "w_gate_up": (h, 2 * i), "w_down": (i, h)}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(dims))
    out = {}
    for key, (name, dim) in zip(keys, dims.items()):
        scale = 1.0 if name.endswith("norm") else dim[0] ** -0.5
        base = 1.0 if name.endswith("norm") else 0.0
        out[name] = (base + scale * jax.random.normal(key, (layers, *dim), jnp.float32)).astype(jnp.bfloat16)
    return out, q


def layer(x, w, q_cols: int, eps: float = 1e-5):
    """One layer's matmuls on x [M, H] with this layer's weights w (a dict of 1-D / 2-D arrays)."""
    import jax
    import jax.numpy as jnp

    def norm(v, g):
        vf = v.astype(jnp.float32)
        return g * (vf * jax.lax.rsqrt(jnp.mean(vf * vf, -1, keepdims=True) + eps)).astype(v.dtype)

    qkv = norm(x, w["attn_norm"]) @ w["wqkv"]
    x = x + qkv[:, :q_cols] @ w["wo"]
    gu = norm(x, w["mlp_norm"]) @ w["w_gate_up"]
    g, u = jnp.split(gu, 2, axis=-1)
    return x + (jax.nn.silu(g) * u) @ w["w_down"]


def forms(layers: int, q_cols: int) -> dict:
    """form name -> f(x, weights) for the weights in that form's layout."""
    import jax

    def loop(x, w):
        return jax.lax.fori_loop(0, layers, lambda i, h: layer(h, {n: a[i] for n, a in w.items()}, q_cols), x)

    def unrolled(x, w):
        for i in range(layers):
            x = layer(x, {n: a[i] for n, a in w.items()}, q_cols)
        return x

    def split(x, ws):
        for w in ws:
            x = layer(x, w, q_cols)
        return x

    return {"loop": loop, "unrolled": unrolled, "split": split}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--rows", default="128,384", help="M: a (5,4,8) verify's rows at batch 16 and 48")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = SHAPES[args.shape]
    layers = args.layers or shape["num_layers"]
    stacked, q_cols = random_weights(shape, layers)
    # One device buffer per layer and weight (sliced once here, on the host's side of the call).
    split = [{n: jnp.array(a[i]) for n, a in stacked.items()} for i in range(layers)]
    jax.block_until_ready(split)
    fns = forms(layers, q_cols)
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        x0 = (0.1 * jax.random.normal(jax.random.PRNGKey(m), (m, shape["hidden_size"]))).astype(jnp.bfloat16)
        outs = {}
        for form in args.forms.split(","):
            w = split if form == "split" else stacked
            t0 = time.perf_counter()
            exe = jax.jit(fns[form]).lower(x0, w).compile()
            compile_s = time.perf_counter() - t0
            outs[form] = np.asarray(exe(x0, w), np.float32)
            x = x0
            for _ in range(5):  # warm
                x = exe(x0, w)
            jax.block_until_ready(x)
            call_ms = []
            t_start = time.perf_counter()
            x = x0
            for _ in range(args.calls):
                t0 = time.perf_counter()
                x = exe(x, w)
                call_ms.append((time.perf_counter() - t0) * 1e3)
            jax.block_until_ready(x)
            wall = (time.perf_counter() - t_start) * 1e3 / args.calls
            row = {"rows": m, "form": form, "arguments": 1 + len(jax.tree_util.tree_leaves(w)),
                   "host_ms_p50": round(statistics.median(call_ms), 4), "wall_ms_per_call": round(wall, 4),
                   "compile_s": round(compile_s, 2)}
            rows.append(row)
            print(f"M {m:4d} {form:9s} args {row['arguments']:4d}: call {row['host_ms_p50']:.3f} ms host (p50), "
                  f"{wall:.3f} ms wall per call, compiled in {compile_s:.1f} s")
        ref = outs.get("unrolled", next(iter(outs.values())))
        for form, o in outs.items():
            err = float(np.max(np.abs(o - ref)) / (np.max(np.abs(ref)) + 1e-9))
            if err > 2e-2:
                raise SystemExit(f"M {m}: form {form} differs from the others (relative max error {err:.3g})")
    result = {"bench": "split_weights", "device": device_kind(), "commit": git_commit(), "shape": args.shape,
              "layers": layers, "calls": args.calls, "rows": rows}
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
