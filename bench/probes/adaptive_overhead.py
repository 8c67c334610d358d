"""What an adaptive engine adds to a round when it runs the static tier's rounds (issue 22).

Session 26 measured the throughput policy 16 % behind static (5,4,8) on MT-bench at batch 16 and 48
while it ran (5,4,8) in every round. This probe splits that: engines in one process, random
SmolLM2-shaped weights (bench/common.py's EAGLE-3 head), acceptance forced to `--simulate-accept` so
every system emits the same tokens a round, one batch of `--batch` requests per run, systems
alternating run by run:

    static       the plain (5,4,8) engine
    ema-pinned   adaptive over `--tiers`, EMA policy held on (5,4,8): results padded to the widest
                 tier, the controller's plumbing, no nested columns
    tp-nonest    the throughput policy held on (5,4,8) over tiers it does not nest (other K): padding,
                 round timing and the policy's per-verify accounting, no nested columns
    tp-pinned    the throughput policy held on (5,4,8) over `--tiers`: the above and the nested
                 tiers' would-be accept lengths on the device
    throughput   the throughput policy free to switch (with forced acceptance it may)

Per run: wall ms per round (the batch's prefills included: compare systems, not batch sizes), the
host's µs per round in the dispatch (the round executable's call apart), in the unpack (the controller
apart) and in the controller, and the median result-to-result gap. The pinned systems never decide
(their buffered verifies fold every MAX_PENDING), so `throughput` against `tp-pinned` adds the
decisions. (Before `f3748b2`+ the "call" timer also counted prefill calls: session 28's logs show
negative "dispatch_less_call" at batch 48 for that reason.)

    python bench/probes/adaptive_overhead.py --batch-sizes 16,48 --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import DRAFT_VOCAB, SHAPES, device_kind, git_commit, random_eagle3_head  # noqa: E402

PINNED = 10**9  # warmup_batches: the policy never decides


def system_config(name: str, tiers: list[list[int]]):
    """The AdaptiveConfig dict of a system (None: static)."""
    if name == "static":
        return None
    if name == "ema-pinned":
        return {"candidate_tiers": tiers, "warmup_batches": PINNED}
    if name == "tp-nonest":  # the base tier and two tiers of another K: nothing nested in (5,4,8)
        return {"policy": "throughput", "candidate_tiers": [[3, 2, 5], [5, 4, 8], [7, 2, 11]], "warmup_batches": PINNED}
    if name == "tp-pinned":
        return {"policy": "throughput", "candidate_tiers": tiers, "warmup_batches": PINNED}
    if name == "throughput":
        return {"policy": "throughput", "candidate_tiers": tiers}
    raise SystemExit(f"unknown system {name!r}")


def instrument(dec, acc: collections.Counter, results: list):
    """Time the decoder's dispatch, the executable call inside it, the unpack, the controller, and any
    calibration (the throughput policy times the tiers at a bucket the warm-up did not; its calls
    are not counted as the round's)."""
    calibrating, stepping = [False], [False]

    def timed(obj, attr, key, after=None):
        f = getattr(obj, attr)

        def g(*a, **k):
            if key == "step":
                stepping[0] = True
            t = time.perf_counter()
            try:
                out = f(*a, **k)
            finally:
                if key == "step":
                    stepping[0] = False
            # "call": a round's executable call only (prefills and calibration runs call `dispatch` too)
            if key != "call" or (stepping[0] and not calibrating[0]):
                acc[key] += time.perf_counter() - t
            if after is not None:
                after(a)
            return out
        setattr(obj, attr, g)

    timed(dec, "step", "step")
    timed(dec, "dispatch", "call")
    timed(dec, "unpack", "unpack", after=lambda a: results.append(time.perf_counter()) if a[0] == "step" else None)
    if dec.controller is not None:
        timed(dec.controller, "on_verify_complete", "controller")
    if dec.timed:
        cal = dec.calibrate

        def calibrate(*a, **k):
            calibrating[0] = True
            try:
                cal(*a, **k)
            finally:
                calibrating[0] = False
            acc["calibrations"] += 1
        dec.calibrate = calibrate
        timed(dec, "calibrate", "calibrate")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="16,48")
    p.add_argument("--systems", default="static,ema-pinned,tp-nonest,tp-pinned,throughput")
    p.add_argument("--tiers", default="3,4,5:5,4,8:7,4,11",
                   help="the adaptive systems' tiers (5,4,8 among them; every reach + 1 >= --simulate-accept)")
    p.add_argument("--simulate-accept", type=float, default=3.2)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--store", default=None, help="executable store (default: a temporary directory)")
    args = p.parse_args(argv)

    from jeagle.adaptive import AdaptiveConfig
    from jeagle.config import ModelConfig
    from jeagle.engine import EngineConfig, speculative
    from jeagle.kernels.settings import KernelSettings
    from jeagle.models.llama import random_model
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig

    cfg = ModelConfig(**SHAPES[args.shape])
    model, head = random_model(cfg), random_eagle3_head(cfg, draft_vocab=DRAFT_VOCAB.get(args.shape))
    tiers = [[int(x) for x in t.split(",")] for t in args.tiers.split(":")]
    store = args.store or tempfile.mkdtemp(prefix="jeagle_store_")
    kernels = KernelSettings.from_env()
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [[100 + (7 * i + j) % 5000 for j in range(args.context)] for i in range(batch)]
        # One batch bucket (the batch): every round runs at it whatever the admission order, and the
        # warm-up compiles a few executables per tier, not every bucket's.
        ec = EngineConfig(max_batch_size=batch, max_context=args.context + args.max_new_tokens + 64, kernels=kernels,
                          executable_cache_dir=store, batch_buckets=(batch,))
        engines, timers = {}, {}
        for name in args.systems.split(","):
            conf = system_config(name, tiers)
            t0 = time.perf_counter()
            eng = speculative(model, head, ec, SpecConfig(5, 4, 8), simulate_accept=args.simulate_accept,
                              adaptive=None if conf is None else AdaptiveConfig.from_dict(conf))
            eng.warmup(batch_sizes=[batch], prefill_lengths=[args.context], greedy=(True,), prefix=(False, True),
                       progress=False)
            eng.generate(prompts, sp)
            eng.generate(prompts, sp)
            acc, results = collections.Counter(), []
            instrument(eng.decoder, acc, results)
            engines[name], timers[name] = eng, (acc, results)
            print(f"batch {batch} {name}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
        for rep in range(args.repeats):
            for name, eng in engines.items():
                dec, (acc, results) = eng.decoder, timers[name]
                acc.clear()
                results.clear()
                if dec.controller is not None:
                    dec.reset_tier()
                r0 = dec.rounds_dispatched
                t0 = time.perf_counter()
                eng.generate(prompts, sp)
                wall = time.perf_counter() - t0
                n = dec.rounds_dispatched - r0
                calibrations = acc.pop("calibrations", 0)
                us = {k: v / n * 1e6 for k, v in acc.items()}
                gaps = [(b - a) * 1e3 for a, b in zip(results, results[1:])]
                row = {"batch": batch, "system": name, "repeat": rep, "rounds": n,
                       "ms_per_round": round(wall / n * 1e3, 3),
                       "gap_median_ms": round(statistics.median(gaps), 3) if gaps else None,
                       "host_us_per_round": {"dispatch_less_call":
                                             round(us["step"] - us["call"] - us.get("calibrate", 0), 1),
                                             "call": round(us["call"], 1),
                                             "unpack_less_controller": round(us["unpack"] - us.get("controller", 0), 1),
                                             "controller": round(us.get("controller", 0), 1),
                                             "calibrate": round(us.get("calibrate", 0), 1)},
                       "calibrations": calibrations,
                       "accept_length": round(eng.last_stats.speculative.accept_length, 3),
                       "compilations_after_warmup": eng.last_stats.compilations_after_warmup}
                if dec.controller is not None:
                    row["active_tier"], row["switches"] = list(dec.spec.shape), dec.controller.switches
                rows.append(row)
                print(json.dumps(row), flush=True)
        for name in engines:
            sel = [r for r in rows if r["batch"] == batch and r["system"] == name]
            print(f"batch {batch} {name}: ms per round " + ", ".join(str(r["ms_per_round"]) for r in sel), flush=True)
        del engines, timers
    print(json.dumps({"bench": "adaptive_overhead", "shape": args.shape, "tiers": tiers, "device": device_kind(),
                      "commit": git_commit(), "simulate_accept": args.simulate_accept, "rows": rows}))


if __name__ == "__main__":
    main()
