"""What switching tiers costs (issue 22): rounds of two tiers in a forced schedule, random weights.

Session 25 saw (7,4,11)'s rounds at batch 16 take 1.7-1.9x (5,4,8)'s in decode with the adaptive policy
switching between them, where their device times differ by 1.11x. This probe takes the policy out: one
speculative engine with both tiers (SmolLM2-shaped random target, bench/common.py's EAGLE-3 head,
acceptance forced to `--simulate-accept` so every tier yields the same tokens a round), and a schedule
that picks the tier of every dispatch: `A` only, `B` only, alternating every round (`AB`), or every `n`
rounds (`A8B8`, ...). Per schedule: wall ms per round over a warm `generate`, and the median
result-to-result gap of rounds after a round of the same tier vs after a switch. Run it once per
XLA_FLAGS setting (e.g. command buffers off: `XLA_FLAGS=--xla_gpu_enable_command_buffer=`). (Since
`2d955dd` an adaptive decoder pads every tier's result to one shape, which removed most of the cost;
the session-26 runs of `--pad-results`, an option that did that by hand, are in bench/HISTORY.md.)

    python bench/probes/tier_switch.py --batch-sizes 16,48 --tiers 5,4,8:7,4,11 --schedules A,B,AB,A8B8
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import DRAFT_VOCAB, SHAPES, device_kind, git_commit, random_eagle3_head  # noqa: E402


def schedule_fn(spec: str):
    """'A' / 'B' / 'AB' / 'A8B8' -> round index -> tier index (0 = A, 1 = B)."""
    runs = [(0 if c == "A" else 1, int(n or 1)) for c, n in re.findall(r"([AB])(\d*)", spec)]
    if not runs or "".join(f"{'AB'[t]}{n if n > 1 else ''}" for t, n in runs) != spec:
        raise SystemExit(f"bad schedule {spec!r}: letters A/B each with an optional count, e.g. A8B8")
    cycle = [t for t, n in runs for _ in range(n)]
    return lambda i: cycle[i % len(cycle)]


def medians(records, same: bool) -> dict:
    """{tier letter: median ms} over (tier, previous tier, ms) records after the same tier (or a switch)."""
    out = {}
    for t in (0, 1):
        ms = [m for u, prev, m in records if u == t and (prev == u) == same and prev is not None]
        if ms:
            out["AB"[t]] = round(statistics.median(ms), 3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="16")
    p.add_argument("--tiers", default="5,4,8:7,4,11", help="A:B, each S,K,N (increasing S)")
    p.add_argument("--schedules", default="A,B,AB,A8B8")
    p.add_argument("--simulate-accept", type=float, default=3.2)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
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
    tiers = [tuple(int(x) for x in t.split(",")) for t in args.tiers.split(":")]
    kernels = KernelSettings.from_env()
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        ec = EngineConfig(max_batch_size=batch, max_context=args.context + args.max_new_tokens + 64, kernels=kernels)
        eng = speculative(model, head, ec, SpecConfig(*tiers[0]), simulate_accept=args.simulate_accept,
                          adaptive=AdaptiveConfig(candidate_tiers=tuple(tiers)))
        dec = eng.decoder
        by_shape = {t.shape: j for j, t in enumerate(dec.tiers)}
        index = [by_shape[t] for t in tiers]  # A, B -> the decoder's tier index
        dec.controller.on_verify_complete = lambda *a, **k: None  # the schedule decides, not the policy
        step, unpack = dec.step, dec.unpack
        pick = [schedule_fn("A")]
        ran = collections.deque()  # tier (0/1) of each dispatched, unread round
        gaps = []  # (tier, previous tier, ms from the previous result)
        dispatch = []  # (tier, previous dispatch's tier, ms the host spent in the dispatch)
        last = [None, None]  # time and tier of the last result

        def step_forced(reqs, b, kv, drain=None):
            t = pick[0](dec.rounds_dispatched)
            dec.controller.policy.index = index[t]  # what the next dispatch runs
            prev = dispatch[-1][0] if dispatch else None
            t0 = time.perf_counter()
            out = step(reqs, b, kv, drain)
            dispatch.append((t, prev, (time.perf_counter() - t0) * 1e3))
            ran.append(t)
            return out

        def unpack_timed(kind, reqs, host):
            if kind == "step":
                now, t = time.perf_counter(), ran.popleft()
                if last[0] is not None:
                    gaps.append((t, last[1], (now - last[0]) * 1e3))
                last[0], last[1] = now, t
            else:
                last[0] = None  # a prefill between: the next gap is not a round's
            return unpack(kind, reqs, host)

        dec.step, dec.unpack = step_forced, unpack_timed
        prompts = [[100 + (7 * i + j) % 5000 for j in range(args.context)] for i in range(batch)]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        eng.warmup(batch_sizes=range(1, batch + 1), prefill_lengths=[args.context], greedy=(True,),
                   prefix=(False, True), progress=False)
        for name in args.schedules.split(","):
            pick[0] = schedule_fn(name)
            eng.generate(prompts, sp)  # warm for this schedule
            for rep in range(args.repeats):
                gaps.clear()
                dispatch.clear()
                last[0] = None
                r0 = dec.rounds_dispatched
                t0 = time.perf_counter()
                eng.generate(prompts, sp)
                wall = time.perf_counter() - t0
                rounds = dec.rounds_dispatched - r0
                same = [g for t, prev, g in gaps if t == prev]
                switched = [g for t, prev, g in gaps if t != prev]
                row = {"batch": batch, "schedule": name, "repeat": rep, "rounds": rounds,
                       "ms_per_round": round(1e3 * wall / rounds, 3),
                       "gap_same_ms": medians(gaps, True), "gap_switched_ms": medians(gaps, False),
                       "dispatch_same_ms": medians(dispatch, True), "dispatch_switched_ms": medians(dispatch, False),
                       "dispatch_total_ms": round(sum(m for _, _, m in dispatch), 1),
                       "n_same": len(same), "n_switched": len(switched),
                       "compilations_after_warmup": eng.last_stats.compilations_after_warmup}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "tier_switch", "shape": args.shape, "tiers": tiers, "device": device_kind(),
                      "commit": git_commit(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "simulate_accept": args.simulate_accept, "rows": rows}))


if __name__ == "__main__":
    main()
