"""Whether deterministic mode's target logits for one row keep their bits when the call has more rows:
the same row (the same tokens, keys at the same positions) alone and as one of 16 or 48 identical rows, one
forward each, random weights of a real model's shape, compiled with the engine's deterministic options.
Variants: RMSNorm's mean square as built (`fixed_order_sum`, elementwise adds in one order) and as XLA's
reduction (`jnp.sum`), the latter also with XLA options that change how its GPU reductions are emitted.
Prints each variant's largest logit difference from the one-row call, and counts the Triton fusions XLA
made (their block sizes are chosen per shape).

    python bench/probes/batch_rows.py --shape smollm2 --rows 1,16,48 --json-out rows.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import deterministic_random_target, device_kind, emit, git_commit  # noqa: E402

XLA_VARIANTS = {  # XLA options tried with RMSNorm on XLA's reduction
    "engine options": {},
    "deterministic reductions": {"xla_gpu_deterministic_reductions": True},
    "no triton normalisation fusions": {"xla_gpu_enable_triton_softmax_fusion": False,
                                        "xla_gpu_experimental_enable_triton_softmax_priority_fusion": False,
                                        "xla_gpu_experimental_enable_fusion_block_level_rewriter": False},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick check)")
    p.add_argument("--rows", default="1,16,48", help="calls' row counts; the first is the reference")
    p.add_argument("--tokens", type=int, default=1, help="tokens per row (1: the decode step's M = rows)")
    p.add_argument("--context", type=int, default=40, help="keys each row's tokens attend to before them")
    p.add_argument("--variants", default="all", help="'fixed', 'xla', or 'all' (fixed + xla under each XLA variant)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jeagle.kernels.settings import use
    from jeagle.models import common
    from jeagle.models.common import AttnInputs
    from jeagle.runtime.executables import compiler_options
    from jeagle.runtime.kv_cache import init_pools

    cfg, model, ks = deterministic_random_target(args.shape, args.layers)
    rows = [int(r) for r in args.rows.split(",")]
    t, c = args.tokens, args.context
    rng = np.random.default_rng(0)
    ctx_tokens = rng.integers(5, cfg.vocab_size, size=(c + t,)).astype(np.int32)
    fixed_sum = common.fixed_order_sum

    def xla_sum(x):
        return jnp.sum(x, axis=-1, keepdims=True)

    variants = []
    if args.variants in ("fixed", "all"):
        variants.append(("fixed-order RMSNorm", fixed_sum, {}))
    if args.variants in ("xla", "all"):
        variants += [(f"XLA RMSNorm, {name}", xla_sum, opts) for name, opts in XLA_VARIANTS.items()]
    doc = {"probe": "batch_rows", "commit": git_commit(), "device": device_kind(), "shape": args.shape,
           "layers": cfg.num_layers, "rows": rows, "tokens": t, "context": c, "backend": ks.resolved(), "results": {}}
    for label, summer, extra in variants:
        common.fixed_order_sum = summer
        got, triton = {}, {}
        try:
            for b in rows:
                # Each row: the context's keys written by a prefill, then `t` new tokens over them (the step's form).
                k, v = init_pools(cfg, num_slots=b * (c + t) + 8)
                table = jnp.asarray((1 + np.arange(b * (c + t))).reshape(b, c + t).astype(np.int32))
                pre = AttnInputs(positions=jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c)),
                                 write_slots=table[:, :c], kv_slots=table[:, :c], kv_len=jnp.full((b,), c, jnp.int32))
                step = AttnInputs(positions=jnp.broadcast_to(jnp.arange(c, c + t, dtype=jnp.int32), (b, t)),
                                  write_slots=table[:, c:], kv_slots=table, kv_len=jnp.full((b,), c + t, jnp.int32))
                opts = compiler_options(ks, cublas_only=True) | extra
                with use(ks):
                    fill = jax.jit(lambda tk, a, k, v: (lambda o: (o.k, o.v))(model(tk, a, k, v, unroll=3)))
                    fwd = jax.jit(lambda tk, a, k, v: model(tk, a, k, v, unroll=3).logits)
                    tokens_pre = jnp.asarray(np.tile(ctx_tokens[:c], (b, 1)))
                    tokens_step = jnp.asarray(np.tile(ctx_tokens[c:], (b, 1)))
                    fill_exe = fill.lower(tokens_pre, pre, k, v).compile(compiler_options=opts or None)
                    k, v = fill_exe(tokens_pre, pre, k, v)
                    exe = fwd.lower(tokens_step, step, k, v).compile(compiler_options=opts or None)
                triton[b] = exe.as_text().count("__triton")
                got[b] = np.asarray(exe(tokens_step, step, k, v).astype(jnp.float32))
        except Exception as e:  # an XLA option this build rejects: say so, go on
            doc["results"][label] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(f"{label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        finally:
            common.fixed_order_sum = fixed_sum
        ref = got[rows[0]][0]
        diff = {b: float(np.abs(g[0] - ref).max()) for b, g in got.items()}
        inner = {b: float(np.abs(g - g[:1]).max()) for b, g in got.items()}
        doc["results"][label] = {"options": extra, "row0_max_abs_diff_vs_first": diff, "rows_differ_within_call": inner,
                                 "row0_bits_equal": {b: bool((g[0] == ref).all()) for b, g in got.items()},
                                 "triton_fusion_mentions": triton}
        print(f"{label}: row 0 vs {rows[0]} row(s): " + ", ".join(f"{b} rows {d:.3g}" for b, d in diff.items())
              + f"; within a call {max(inner.values()):.3g}; triton fusions {triton}", flush=True)
    emit(doc, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
