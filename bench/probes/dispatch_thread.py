"""Would a dispatch thread hide the served engine's Python behind XLA's per-call host work? (issue 24)

At 32 clients the served engine's thread is busy ~0.9 of the wall (bench/HISTORY.md sessions 30-31): about
two thirds of it inside the executables' calls, a third Python (admission, reading results, delivery,
the pipe). JAX releases the GIL while XLA executes a call (checked on the CPU: a Python loop beside a
thread that calls an executable runs at full speed), so the engine's Python could run while another
thread is inside the next round's call. This probe measures what that would give, before the engine is
changed: one warm round executable (random SmolLM2-shaped target + EAGLE-3 head, padding rows) called in
a loop through the decoder's own `dispatch` (jeagle/runtime/dispatch.py), each step with `--python-ms` of
pure-Python work standing in for the engine's processing of the previous round, in two forms:

    serial   call round c, then the Python work, then read round c-1's result (EngineConfig.dispatch_thread off)
    thread   hand round c's call to the dispatch thread (once it has begun), do the Python work meanwhile,
             wait for the call, then read round c-1's result (dispatch_thread on)

It prints, per batch size and Python load, the wall ms per step of each form and their ratio, and the
hand-over's host ms (p50: the whole call, serially). `--switch-interval` sets Python's GIL switch
interval: the call's return needs the GIL back from the Python work.

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
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval (Python's default 0.005): how soon a thread waiting for the GIL gets it")
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
    from jeagle.runtime.dispatch import resolve
    from jeagle.spec.round import SpecConfig

    cfg = ModelConfig(**SHAPES[args.shape])
    model, head = random_model(cfg), random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape))
    kernels = dataclasses.replace(KernelSettings.from_env(), slice_fusion=args.slice_fusion == "on")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    rows_out = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        eng = speculative(model, head, EngineConfig(max_batch_size=b, max_context=args.context, kernels=kernels),
                          SpecConfig(*map(int, args.tier.split(","))), simulate_accept=3.2)
        dec = eng.decoder
        kv = max(k.kv_len for k in eng.warmup_plan(batch_sizes=[b], greedy=(True,)) if k.phase == "round")
        exe = dec.executables.get(dec.round_key(dec.spec, b, kv, True))
        rows = jax.device_put(pad([], b, dec.scratch_row, np.int32))

        def run(form, ms):  # one pass of --calls steps through the decoder's own dispatch (runtime/dispatch.py)
            dec.state  # noqa: B018 (waits for any call in flight before the dispatch mode changes)
            dec.use_dispatch_thread(form == "thread")
            inflight, call_s = collections.deque(), []
            jax.block_until_ready(dec.state)
            start = time.perf_counter()
            for _ in range(args.calls):
                t0 = time.perf_counter()
                res = dec.dispatch(exe, rows)  # thread: handed over once the dispatch thread has begun it
                call_s.append(time.perf_counter() - t0)
                python_work(ms)  # the engine's processing of the last round, beside this one's call
                res = resolve(res)  # the engine joins at the next step's start
                inflight.append(res)
                if len(inflight) > 1:
                    np.asarray(inflight.popleft())
            while inflight:
                np.asarray(inflight.popleft())
            return (time.perf_counter() - start) * 1e3 / args.calls, statistics.median(call_s) * 1e3

        run("serial", 0.0), run("thread", 0.0)  # untimed: the executable's first calls, in both forms
        for ms in (float(x) for x in args.python_ms.split(",")):
            for form in ("serial", "thread") * 3:  # alternating, three each: their spread is the noise
                wall, call_ms = run(form, ms)
                row = {"batch": b, "python_ms": ms, "form": form, "wall_ms_per_step": round(wall, 3),
                       "hand_over_ms_p50": round(call_ms, 3)}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
        dec.use_dispatch_thread(False)
    for b in sorted({r["batch"] for r in rows_out}):
        for ms in sorted({r["python_ms"] for r in rows_out}):
            walls = {f: statistics.median(r["wall_ms_per_step"] for r in rows_out
                                          if (r["batch"], r["python_ms"], r["form"]) == (b, ms, f))
                     for f in ("serial", "thread")}
            print(f"batch {b:>3} python {ms:.1f} ms: serial {walls['serial']:.3f} ms/step, thread "
                  f"{walls['thread']:.3f} ({walls['serial'] / walls['thread']:.2f}x)")
    print(json.dumps({"bench": "dispatch_thread", "shape": args.shape, "tier": args.tier, "device": device_kind(),
                      "commit": git_commit(), "slice_fusion": args.slice_fusion,
                      "switch_interval": sys.getswitchinterval(), "rows": rows_out}))


if __name__ == "__main__":
    main()
