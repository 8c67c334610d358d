"""The host's time inside one round executable's call (issue 22): which inputs and outputs make it cost.

host_profile.py put JAX's `Compiled.__call__` at 0.65 ms of host time per round at batch 1 and 1.06 ms
at 16 on the H100 (random SmolLM2 + head, (5,4,8)). XLA re-records a command buffer when the
addresses of the buffers its commands use change (openxla/xla#6668): a new `row_ids` array every call
and a new result buffer every call are candidates. This probe calls one warm round executable on
padding rows in a loop, `--calls` times per mode, and prints the median host ms of the call itself
and the wall ms per call:

    numpy       row ids as a new NumPy array each call (what the decoder does), results read one call late
    device      the same device array of row ids every call, results read one call late
    device-sync the same device array, each result read before the next call (no result in flight)

    python bench/probes/exec_call.py --batch-sizes 1,16 [--unroll 3,all] [--modes device] [--logprobs 0,1]

`--unroll` compares the round executable's layer loop (EngineConfig.unroll_layers: `auto` the engine's
default, `all` every layer inline, k layers per iteration), each in its own engine; `--logprobs 0,1`
the round without and with the emitted tokens' logprobs (`jeagle/logprobs.py`) in one engine.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import DRAFT_VOCAB, SHAPES, device_kind, git_commit, random_eagle3_head  # noqa: E402

MODES = ("numpy", "device", "device-sync")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--unroll", default="auto", help="comma list of auto | all | loop | k (layers per iteration)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--logprobs", default="0", help="comma list of 0 | 1: the round executable with logprobs")
    p.add_argument("--hlo-out", default=None, metavar="DIR",
                   help="write each round executable's optimized HLO there and print what its entry runs outside "
                        "XLA's command buffers (the thunks the host launches one by one)")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    unrolls = {"auto": None, "all": True, "loop": False}

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
    rows_out = []
    for b, unroll in [(int(x), u) for x in args.batch_sizes.split(",") for u in args.unroll.split(",")]:
        t_build = time.perf_counter()
        eng = speculative(model, head, EngineConfig(max_batch_size=b, max_context=args.context,
                                                    unroll_layers=unrolls[unroll] if unroll in unrolls else int(unroll),
                                                    kernels=KernelSettings.from_env()),
                          SpecConfig(*map(int, args.tier.split(","))), simulate_accept=3.2)
        dec = eng.decoder
        kv = max(k.kv_len for k in eng.warmup_plan(batch_sizes=[b], greedy=(True,)) if k.phase == "round")
        exes = {lp: dec.executables.get(dec.round_key(dec.spec, b, kv, True, lp))
                for lp in [bool(int(x)) for x in args.logprobs.split(",")]}
        build_s = round(time.perf_counter() - t_build, 1)  # the engine and its round executables' compile
        if args.hlo_out:
            for lp, exe in exes.items():
                print(json.dumps({"batch": b, "unroll": unroll, "logprobs": lp, "entry": hlo_summary(
                    exe.as_text(), Path(args.hlo_out) / f"round_b{b}_{unroll}{'_lp' if lp else ''}.hlo")}))
        rows_np = pad([], b, dec.scratch_row, np.int32)
        rows_dev = jax.device_put(rows_np)
        for mode, lp in [(m, lp) for m in modes for lp in exes] * 2:  # twice, alternating: the spread is the noise
            exe = exes[lp]
            inflight = collections.deque()
            call_ms = []
            jax.block_until_ready(dec.state)
            t_start = time.perf_counter()
            for _ in range(args.calls):
                inputs = np.array(rows_np) if mode == "numpy" else rows_dev
                t0 = time.perf_counter()
                res, dec.state = exe(dec.param_leaves, dec.state, inputs)
                call_ms.append((time.perf_counter() - t0) * 1e3)
                res.copy_to_host_async()
                inflight.append(res)
                if mode == "device-sync" or len(inflight) > 1:
                    np.asarray(inflight.popleft())
            while inflight:
                np.asarray(inflight.popleft())
            wall = (time.perf_counter() - t_start) * 1e3 / args.calls
            row = {"batch": b, "unroll": unroll, "logprobs": lp, "kv": kv, "mode": mode, "build_s": build_s,
                   "call_ms_p50": round(statistics.median(call_ms), 3),
                   "call_ms_p90": round(float(np.percentile(call_ms, 90)), 3), "wall_ms_per_call": round(wall, 3)}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "exec_call", "shape": args.shape, "tier": args.tier, "device": device_kind(),
                      "commit": git_commit(), "rows": rows_out}))


def hlo_summary(text: str, path: Path) -> dict:
    """Counts of the entry computation's instructions by kind: calls of command buffers vs everything else."""
    import re

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    entry = text[text.index("ENTRY "):]
    entry = entry[:entry.index("\n}")]
    counts = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"= \S+(?:\{[^}]*\})? ([a-z-]+)\(", line) or re.search(r" ([a-z-]+)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            op += ":" + (t.group(1) if t else "?")
        elif op == "call":
            op += ":command_buffer" if "command_buffer" in line else ":other"
        counts[op] += 1
    return dict(counts.most_common())


if __name__ == "__main__":
    main()
