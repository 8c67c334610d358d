"""Autoregressive decode throughput of the jeagle engine (target only), per batch size.

Measures one defined thing: greedy generation of `--max-new-tokens` tokens (EOS ignored) for a batch
of copies of one chat prompt, after a warm-up run that compiles every executable the timed run uses;
the clock covers `Engine.generate` (prefill included, compilation excluded) and everything the host
does in between. Prints a table, then one JSON line.

    python bench/decode.py --batch-sizes 1,16 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Hugging Face transformers 5.17, static cache + torch.compile, same H100, SmolLM2 bf16, 256 tokens
# (shared/GPU.md, 2026-11-22): the peer figures this benchmark is compared against.
HF_REFERENCE_TOKS = {1: 334.8, 16: 4064.9}


def git_commit() -> str:
    if os.environ.get("JEAGLE_COMMIT"):  # the GPU runner gets a copy of the tree without .git
        return os.environ["JEAGLE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def measure(engine, prompt_ids, batch: int, max_new: int, repeats: int):
    from jeagle.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    engine.generate([prompt_ids] * batch, sp)  # warm-up: compiles every shape used below
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = engine.generate([prompt_ids] * batch, sp)
        wall = time.perf_counter() - t0
        assert engine.last_stats["compile_s"] == 0.0, "timed run compiled"
        runs.append((sum(len(o.token_ids) for o in outs) / wall, wall))
    runs.sort()
    return runs[len(runs) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--decode-steps", default="1", help="comma list of tokens per decode dispatch to compare")
    p.add_argument("--unroll", default="0", help="comma list of 0/1: layer loop vs unrolled layers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    p.add_argument("--json-out", default=None, help="also write the JSON document to this file")
    args = p.parse_args(argv)

    import jax

    from jeagle.checkpoint import load_model
    from jeagle.engine import Engine, EngineConfig
    from jeagle.fetch import resolve_target
    from jeagle.tokenizer import Tokenizer

    target = resolve_target(args.target, quiet=True)
    model = load_model(target)
    tok = Tokenizer.from_dir(target)
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx_state(model)))
    rows = []
    for unroll in [bool(int(u)) for u in args.unroll.split(",")]:
        for steps in [int(s) for s in args.decode_steps.split(",")]:
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                engine = Engine(model, EngineConfig(max_batch_size=batch, decode_steps=steps, unroll_layers=unroll,
                                                    max_context=1024))
                t0 = time.perf_counter()
                toks_per_s, wall = measure(engine, prompt_ids, batch, args.max_new_tokens, args.repeats)
                step_ms = 1e3 * wall / args.max_new_tokens
                rows.append({
                    "batch": batch, "decode_steps": steps, "unroll": unroll, "tokens_per_s": round(toks_per_s, 1),
                    "step_ms": round(step_ms, 3), "weight_GBps": round(weight_bytes / (step_ms / 1e3) / 1e9, 1),
                    "compile_s": round(engine.compile_seconds, 2), "bench_s": round(time.perf_counter() - t0, 1),
                    "vs_hf": round(toks_per_s / HF_REFERENCE_TOKS[batch], 2) if batch in HF_REFERENCE_TOKS else None,
                })
    dev = jax.devices()[0]
    doc = {
        "bench": "decode", "model": str(target.name), "prompt_tokens": len(prompt_ids),
        "max_new_tokens": args.max_new_tokens, "device": getattr(dev, "device_kind", dev.platform),
        "jax": jax.__version__, "python": platform.python_version(), "commit": git_commit(),
        "weight_bytes": weight_bytes, "hf_reference_tokens_per_s": HF_REFERENCE_TOKS, "rows": rows,
    }
    hdr = f"{'batch':>5} {'steps':>5} {'unroll':>6} {'tok/s':>10} {'step ms':>8} {'weights GB/s':>12} {'vs HF':>6} {'compile s':>9}"
    print(hdr)
    for r in rows:
        print(f"{r['batch']:>5} {r['decode_steps']:>5} {str(r['unroll']):>6} {r['tokens_per_s']:>10.1f} "
              f"{r['step_ms']:>8.3f} {r['weight_GBps']:>12.1f} {str(r['vs_hf']):>6} {r['compile_s']:>9.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return doc


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


if __name__ == "__main__":
    main()
