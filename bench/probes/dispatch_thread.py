"""Would a dispatch thread hide the served engine's Python behind XLA's per-call host work? (issue 24)

At 32 clients the served engine's thread is busy ~0.9 of the wall (bench/HISTORY.md sessions 30-31): about
two thirds of it inside the executables' calls, a third Python (admission, reading results, delivery,
the pipe). JAX releases the GIL while XLA executes a call (checked on the CPU: a Python loop beside a
thread that calls an executable runs at full speed), so the engine's Python could run while another
thread is inside the next round's call. This probe measures what that would give, before the engine is
changed: one warm round executable (random SmolLM2-shaped target + EAGLE-3 head, padding rows) called in
a loop, each step with `--python-ms` of pure-Python work standing in for the engine's processing of the
previous round, in two forms:

    serial   call round c, then the Python work, then read round c-1's result (what Engine.step does)
    thread   hand round c's call to a dispatch thread, do the Python work meanwhile, wait for the call,
             then read round c-1's result

It prints, per batch size and Python load, the wall ms per step of each form and their ratio, and the
call's host ms (p50) in each (the call may take longer while Python holds the GIL beside it).

    python bench/probes/dispatch_thread.py --batch-sizes 1,32 --python-ms 0,0.6,1.2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import DRAFT_VOCAB, SHAPES, device_kind, git_commit, random_eagle3_head  # noqa: E402


def python_work(ms: float) -> None:
    """Pure-Python work holding the GIL for about `ms` milliseconds (a loop of small-object churn, as the
    engine's bookkeeping is)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        d = {i: [i, i + 1] for i in range(32)}
        sum(len(v) for v in d.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--python-ms", default="0,0.6,1.2", help="comma list: Python work per step (ms)")
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--slice-fusion", choices=["on", "off"], default="off",
                   help="XLA's dynamic-slice fusions (the server's default: off)")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from jeagle.config import ModelConfig
    from jeagle.engine import EngineConfig, speculative
    from jeagle.kernels.settings import KernelSettings
    from jeagle.models.llama import random_model
    from jeagle.runtime.buckets import pad
    from jeagle.spec.round import SpecConfig

    cfg = ModelConfig(**SHAPES[args.shape])
    model, head = random_model(cfg), random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape))
    kernels = dataclasses.replace(KernelSettings.from_env(), slice_fusion=args.slice_fusion == "on")
    pool = ThreadPoolExecutor(1, thread_name_prefix="dispatch")
    rows_out = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        eng = speculative(model, head, EngineConfig(max_batch_size=b, max_context=args.context, kernels=kernels),
                          SpecConfig(*map(int, args.tier.split(","))), simulate_accept=3.2)
        dec = eng.decoder
        kv = max(k.kv_len for k in eng.warmup_plan(batch_sizes=[b], greedy=(True,)) if k.phase == "round")
        exe = dec.executables.get(dec.round_key(dec.spec, b, kv, True))
        rows = jax.device_put(pad([], b, dec.scratch_row, np.int32))

        def call():
            t0 = time.perf_counter()
            res, dec.state = exe(dec.param_leaves, dec.state, rows)
            res.copy_to_host_async()
            return res, time.perf_counter() - t0

        for _ in range(20):  # untimed: the executable's first calls, on this thread and on the dispatch thread
            np.asarray(call()[0])
            np.asarray(pool.submit(call).result()[0])
        for ms in (float(x) for x in args.python_ms.split(",")):
            for form in ("serial", "thread") * 3:  # alternating, three each: their spread is the noise
                inflight, call_s = collections.deque(), []
                jax.block_until_ready(dec.state)
                start = time.perf_counter()
                for _ in range(args.calls):
                    if form == "serial":
                        res, spent = call()
                        python_work(ms)
                    else:
                        future = pool.submit(call)
                        python_work(ms)
                        res, spent = future.result()
                    call_s.append(spent)
                    inflight.append(res)
                    if len(inflight) > 1:
                        np.asarray(inflight.popleft())
                while inflight:
                    np.asarray(inflight.popleft())
                row = {"batch": b, "python_ms": ms, "form": form,
                       "wall_ms_per_step": round((time.perf_counter() - start) * 1e3 / args.calls, 3),
                       "call_ms_p50": round(1e3 * statistics.median(call_s), 3)}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    pool.shutdown()
    for b in sorted({r["batch"] for r in rows_out}):
        for ms in sorted({r["python_ms"] for r in rows_out}):
            walls = {f: statistics.median(r["wall_ms_per_step"] for r in rows_out
                                          if (r["batch"], r["python_ms"], r["form"]) == (b, ms, f))
                     for f in ("serial", "thread")}
            print(f"batch {b:>3} python {ms:.1f} ms: serial {walls['serial']:.3f} ms/step, thread "
                  f"{walls['thread']:.3f} ({walls['serial'] / walls['thread']:.2f}x)")
    print(json.dumps({"bench": "dispatch_thread", "shape": args.shape, "tier": args.tier, "device": device_kind(),
                      "commit": git_commit(), "slice_fusion": args.slice_fusion, "rows": rows_out}))


if __name__ == "__main__":
    main()
