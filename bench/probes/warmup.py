"""Start-up cost: the ahead-of-time warm-up of the default speculative configuration, cold and warm.

Random SmolLM2-shaped target and EAGLE-1 head (compile time depends on shapes, not weights), the
default buckets for `--max-batch` running requests, tier 5,4,8, greedy and sampled round variants:
the engine's whole `warmup_plan()`, compiled for real (no projection).

    cold  a fresh process, empty executable store and no JAX compilation cache: every executable is
          compiled by warm-up worker processes (`--processes`; the engine's auto: one per CPU up to 8
          on a GPU, up to 8) into the store and loaded from it, or with `--processes 0` traced and lowered on
          the main thread and compiled on `--workers` threads.
    warm  a fresh process with the store the cold run filled: every executable loads from it.
Each runs in its own process (as a real start-up does); prints a table, then one JSON line.

    python bench/probes/warmup.py --max-batch 48 --workers 8
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, random_target_and_head  # noqa: E402


def child(args):
    from jeagle.engine import EngineConfig, speculative
    from jeagle.kernels.settings import KernelSettings
    from jeagle.spec.round import SpecConfig

    t0 = time.perf_counter()
    model, head = random_target_and_head(args.shape)
    engine = speculative(model, head, EngineConfig(max_batch_size=args.max_batch, max_context=args.max_context,
                                                   executable_cache_dir=args.store, compile_workers=args.workers,
                                                   compile_processes=args.processes, kernels=KernelSettings.from_env()),
                         SpecConfig(5, 4, 8))
    greedy = (True,) if args.greedy_only else (True, False)
    plan = engine.warmup_plan(greedy=greedy)  # step keys: each has a phase ("prefill" or "round")
    seconds = engine.warmup(greedy=greedy, progress=False)
    store = engine.executables.store  # None without --store (or under a mesh)
    bk = engine.buckets
    print(json.dumps({"seconds": round(seconds, 2), "executables": len(plan),
                      "prefill": sum(key.phase == "prefill" for key in plan),
                      "rounds": sum(key.phase == "round" for key in plan),
                      "loaded": store.loaded if store is not None else 0,
                      "compiled": store.saved if store is not None else engine.num_compiled,
                      "process_s": round(time.perf_counter() - t0, 2),
                      "buckets": {"batch": bk.batch, "prefill_batch": bk.prefill_batch,
                                  "prefill_len": bk.prefill_len, "kv": bk.kv}}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--max-batch", type=int, default=48)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--workers", type=int, default=16, help="compile/load threads")
    p.add_argument("--processes", type=int, default=None, help="warm-up worker processes (default: the engine's auto)")
    p.add_argument("--greedy-only", action="store_true")
    p.add_argument("--store", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)

    store = args.store or tempfile.mkdtemp(prefix="jeagle-exe-")
    base = [sys.executable, __file__, "--child", "--shape", args.shape, "--max-batch", str(args.max_batch),
            "--max-context", str(args.max_context), "--workers", str(args.workers), "--store", store]
    if args.processes is not None:
        base += ["--processes", str(args.processes)]
    if args.greedy_only:
        base.append("--greedy-only")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    runs = {}
    for name in ("cold", "warm"):
        out = subprocess.run(base, capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"{name} run failed:\n{out.stderr[-4000:]}")
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    dev = device_kind()
    c, w = runs["cold"], runs["warm"]
    print(f"device {dev}; plan: {c['executables']} executables ({c['prefill']} prefill, {c['rounds']} round); "
          f"buckets {c['buckets']}")
    print("| start-up | warm-up s | compiled in this process | loaded from the store (cold: compiled by workers) | process s |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        print(f"| {name} ({args.workers} threads, processes {args.processes or 'auto'}) | {r['seconds']} | "
              f"{r['compiled']} | {r['loaded']} | "
              f"{r['process_s']} |")
    print(json.dumps({"bench": "warmup", "device": dev, "shape": args.shape, "max_batch": args.max_batch,
                      "max_context": args.max_context, "workers": args.workers, "processes": args.processes,
                      "greedy_only": args.greedy_only,
                      "cold": c, "warm": w}))


if __name__ == "__main__":
    main()
