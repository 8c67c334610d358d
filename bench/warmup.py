"""Start-up cost: how long the ahead-of-time warm-up of the default speculative configuration takes,
cold and from the persistent compilation cache.

Random SmolLM2-shaped target and EAGLE-1 head (compile time depends on shapes, not weights), default
buckets for `--max-batch` running requests, tier 5,4,8. Compiling the whole default plan can take far
longer than one device call allows, so this compiles a sample of it (`--sample-batches` ×
`--sample-prefill` × `--sample-kv`, greedy), times every executable, and projects the full plan
from the mean per phase. Then a fresh process with the same `--cache-dir` warms the same sample up
from the persistent cache. Prints a table, then one JSON line.

    python bench/warmup.py --max-batch 48
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(args):
    from jeagle.engine import EngineConfig
    from jeagle.spec.engine import SpecEngine
    from jeagle.spec.round import SpecConfig
    from profile_decode import random_target_and_head

    model, head = random_target_and_head(args.shape)
    return SpecEngine(model, head, EngineConfig(max_batch_size=args.max_batch, max_context=args.max_context),
                      SpecConfig(5, 4, 8))


def sample_times(engine, args):
    """Seconds per executable of the sample plan, in plan order."""
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    plan = engine.warmup_plan(batch_sizes=ints(args.sample_batches), prefill_lengths=ints(args.sample_prefill),
                              kv_lengths=ints(args.sample_kv), greedy=(True,))
    out = []
    for phase, b, size, g in plan:
        t0 = time.perf_counter()
        engine.warmup(batch_sizes=[b], prefill_lengths=[size] if phase == "prefill" else [],
                      kv_lengths=[size] if phase == "decode" else [], greedy=(g,), progress=False)
        out.append({"phase": phase, "batch": b, "size": size, "seconds": round(time.perf_counter() - t0, 3)})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--max-batch", type=int, default=48)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--sample-batches", default="1,16,48")
    p.add_argument("--sample-prefill", default="256")
    p.add_argument("--sample-kv", default="512")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--from-cache", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    cache = args.cache_dir or tempfile.mkdtemp(prefix="jeagle-xla-")
    from jeagle.runtime import enable_compile_cache

    enable_compile_cache(cache)
    import jax

    engine = build(args)
    times = sample_times(engine, args)
    if args.from_cache:
        print(json.dumps(times))
        return
    full = engine.warmup_plan()
    full_greedy = engine.warmup_plan(greedy=(True,))
    mean = {ph: sum(t["seconds"] for t in times if t["phase"] == ph) / max(1, sum(t["phase"] == ph for t in times))
            for ph in ("prefill", "decode")}
    projected = {name: round(sum(mean[x[0]] for x in plan), 1) for name, plan in (("full", full),
                                                                                   ("greedy_only", full_greedy))}
    proc = subprocess.run([sys.executable, __file__, "--from-cache", "--cache-dir", cache, "--shape", args.shape,
                           "--max-batch", str(args.max_batch), "--max-context", str(args.max_context),
                           "--sample-batches", args.sample_batches, "--sample-prefill", args.sample_prefill,
                           "--sample-kv", args.sample_kv], capture_output=True, text=True, check=True)
    cached = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{'phase':>8} {'batch':>5} {'size':>5} {'cold s':>8} {'cached s':>8}")
    for t, c in zip(times, cached):
        print(f"{t['phase']:>8} {t['batch']:>5} {t['size']:>5} {t['seconds']:>8.2f} {c['seconds']:>8.2f}")
    counts = {name: {ph: sum(x[0] == ph for x in plan) for ph in ("prefill", "decode")}
              for name, plan in (("full", full), ("greedy_only", full_greedy))}
    print(f"default plan: {counts['full']} executables; projected cold warm-up {projected['full']} s "
          f"(greedy only: {counts['greedy_only']}, {projected['greedy_only']} s)")
    print(json.dumps({"bench": "warmup", "shape": args.shape, "max_batch": args.max_batch,
                      "max_context": args.max_context, "device": jax.devices()[0].device_kind,
                      "commit": os.environ.get("JEAGLE_COMMIT", "unknown"), "sample": times, "cached": cached,
                      "plan_counts": counts, "projected_cold_s": projected,
                      "buckets": {"batch": engine.batch_buckets, "prefill": engine.prefill_buckets,
                                  "kv": engine.kv_buckets}}))


if __name__ == "__main__":
    main()
