"""Whether deterministic mode's target logits keep their bits when only the layer loop's form changes:
the plain loop, `--unroll` layers per iteration (the decode step's form), the loop cut at EAGLE-3's aux
layers (the verify's form: segments of other lengths, so other layers share an unrolled body), every
layer inline. One prefill-shaped forward per form over the same tokens, random weights of a real model's
shape, compiled with the engine's deterministic options (XLA's excess precision off) and again with
excess precision on (XLA's default, which lets a fusion keep fp32 across a bf16 rounding between ops).
Prints each form's largest logit difference from the first form's, per option set.

    python bench/probes/loop_forms.py --shape smollm2 --aux-layers 2,15,27 --json-out forms.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import deterministic_random_target, device_kind, emit, git_commit  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick check)")
    p.add_argument("--aux-layers", default="2,15,27")
    p.add_argument("--unroll", type=int, default=3)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jeagle.kernels.settings import use
    from jeagle.models.common import AttnInputs
    from jeagle.runtime.executables import compiler_options
    from jeagle.runtime.kv_cache import init_pools

    cfg, model, ks = deterministic_random_target(args.shape, args.layers)
    aux = tuple(int(x) for x in args.aux_layers.split(",") if int(x) <= cfg.num_layers)
    b, t = args.rows, args.tokens
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(5, cfg.vocab_size, size=(b, t)).astype(np.int32))
    table = jnp.asarray((1 + np.arange(b * t)).reshape(b, t).astype(np.int32))
    attn = AttnInputs(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), write_slots=table,
                      kv_slots=table, kv_len=jnp.full((b,), t, jnp.int32))
    forms = {"unroll": dict(unroll=args.unroll), "unroll+aux": dict(unroll=args.unroll, aux_layers=aux),
             "loop": dict(unroll=False), "loop+aux": dict(unroll=False, aux_layers=aux), "inline": dict(unroll=True)}
    doc = {"probe": "loop_forms", "commit": git_commit(), "device": device_kind(), "shape": args.shape,
           "layers": cfg.num_layers, "aux_layers": aux, "unroll": args.unroll, "backend": ks.resolved(),
           "results": {}}
    for label, extra in (("excess precision on", {"xla_allow_excess_precision": True}), ("engine options", {})):
        opts = compiler_options(ks, cublas_only=True) | extra
        got = {}
        for name, kw in forms.items():
            k, v = init_pools(cfg, num_slots=b * t + 8)
            with use(ks):
                fn = jax.jit(lambda tk, a, k, v, kw=kw: model(tk, a, k, v, **kw).logits)
                exe = fn.lower(tokens, attn, k, v).compile(compiler_options=opts or None)
            got[name] = np.asarray(exe(tokens, attn, k, v))
        first = next(iter(got.values()))
        diffs = {n: float(np.abs(g - first).max()) for n, g in got.items()}
        doc["results"][label] = {"options": opts, "max_abs_diff_vs_first": diffs,
                                 "argmax_equal": {n: bool((g.argmax(-1) == first.argmax(-1)).all()) for n, g in got.items()}}
        print(f"{label}: " + ", ".join(f"{n} {d:.3g}" for n, d in diffs.items()), flush=True)
    emit(doc, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
