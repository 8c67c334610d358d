"""The output head's fp32 logits for a few rows (a prefill's last positions, a batch-1 decode): which
kernels XLA picks and what they cost, per way of writing the product.

A prefill asks for logits at one position per row: `x = hidden[rows, last]` ([B, H] bf16) times the
head [V, H] with fp32 output. On the H100 XLA lowered the B = 1 case to a conversion of the whole head
to fp32 (`wrapped_convert`, 1.05 ms for Llama-3.1-8B's 128,256 x 4,096 head) and a cuBLAS fp32 gemv
(0.67 ms), against ~0.35 ms to read the bf16 head once (bench/HISTORY.md session 29). Variants:

  gather_norm   the norm over every position, then the rows gathered, then the dot (the model's form)
  norm_gather   the rows gathered from the pre-norm states, normalised, then the dot
  rows2, rows8  as norm_gather, the rows padded to 2 / 8 (a GEMM, not a gemv), the first B kept
  f32_acc_bf16  the dot's output in bf16 (not an option for the model: the floor of one bf16 read)

    python bench/probes/logits_dot.py --shapes llama8b,smollm2 --batch-sizes 1,4
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import SHAPES, device_kind, emit, git_commit  # noqa: E402


def variants():
    import jax.numpy as jnp

    from jeagle.models.common import rms_norm

    def gather_norm(h, w, head, idx):
        hid = rms_norm(h, w, 1e-5)
        x = hid[jnp.arange(h.shape[0]), idx]
        return jnp.einsum("...h,vh->...v", x, head, preferred_element_type=jnp.float32)

    def norm_gather(h, w, head, idx):
        x = rms_norm(h[jnp.arange(h.shape[0]), idx], w, 1e-5)
        return jnp.einsum("...h,vh->...v", x, head, preferred_element_type=jnp.float32)

    def padded(rows):
        def fn(h, w, head, idx):
            x = rms_norm(h[jnp.arange(h.shape[0]), idx], w, 1e-5)
            b = x.shape[0]
            xp = jnp.zeros((max(rows, b), x.shape[1]), x.dtype).at[:b].set(x)
            return jnp.einsum("...h,vh->...v", xp, head, preferred_element_type=jnp.float32)[:b]
        return fn

    def f32_acc_bf16(h, w, head, idx):
        x = rms_norm(h[jnp.arange(h.shape[0]), idx], w, 1e-5)
        return jnp.einsum("...h,vh->...v", x, head).astype(jnp.float32)

    return {"gather_norm": gather_norm, "norm_gather": norm_gather, "rows2": padded(2), "rows8": padded(8),
            "f32_acc_bf16": f32_acc_bf16}


def kernels_of(compiled) -> list[str]:
    """The fusions / custom calls of the optimized HLO's entry computation that do the work."""
    text = compiled.as_text()
    entry = text[text.find("ENTRY"):]
    entry = entry[: entry.find("\n}")]
    out = []
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?(\S+) = \S+ (fusion|custom-call)\(", line)
        if m:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            out.append(m.group(1) + (f" [{target.group(1)}]" if target else ""))
    return out[:12]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama8b,smollm2")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--tokens", type=int, default=64, help="positions per row (the prefill's padded length)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--options", default="default,cublas",
                   help="XLA options per compile: default, cublas (Triton GEMM fusions off: what the engine's "
                        "prefill and round executables compile with)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    doc = {"bench": "logits_dot", "device": device_kind(), "commit": git_commit(), "rows": []}
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        hs, v = cfg["hidden_size"], cfg["vocab_size"]
        key = jax.random.PRNGKey(0)
        head = (jax.random.normal(key, (v, hs), jnp.float32) * 0.02).astype(jnp.bfloat16)
        w = jnp.ones((hs,), jnp.bfloat16)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            h = jax.random.normal(jax.random.PRNGKey(b), (b, args.tokens, hs), jnp.bfloat16)
            idx = jnp.full((b,), args.tokens - 1, jnp.int32)
            ref = None
            for opt, (name, fn) in itertools.product(args.options.split(","), variants().items()):
                f = jax.jit(fn)
                xla = {"xla_gpu_enable_triton_gemm": False} if opt == "cublas" and jax.default_backend() == "gpu" else {}
                compiled = f.lower(h, w, head, idx).compile(compiler_options=xla or None)
                out = compiled(h, w, head, idx)
                out.block_until_ready()
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    compiled(h, w, head, idx).block_until_ready()
                    times.append(time.perf_counter() - t0)
                got = np.asarray(out, np.float32)
                ref = got if ref is None else ref
                row = {"shape": shape, "batch": b, "options": opt, "variant": name, "ms": round(statistics.median(times) * 1e3, 4),
                       "head_read_floor_ms_at_3p35TBps": round(head.nbytes / 3.35e12 * 1e3, 4),
                       "max_abs_diff_vs_first": float(np.max(np.abs(got - ref))), "kernels": kernels_of(compiled)}
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
    emit(doc, args.json_out)
    return doc


if __name__ == "__main__":
    main()
