"""What the host did between two rounds, and what the next round's call cost.

The 2026-11-27 measurements (bench/HISTORY.md) found that a round executable's call re-records its XLA command buffers (host time in the
call, up to ~2 ms at batch 16-48) when the buffers it meets sit at other addresses than on its last call:
after a tier switch, or anything else that allocated on the device in between. Continuous batching
(2026-11-28: rounds 0.5-0.7 ms dearer than static waves) and the adaptive engine (runs spread 28k-48k tok/s
at batch 48) both put more between rounds than a static wave does: prefill calls, slot-table reads of
finished requests, slot-table updates, bucket and tier changes. This wraps the decoder's `step`,
`prefill`, `read_tables` and `assign_slots` of a warm engine (SmolLM2 + the shipped head, MT-bench first
turns, greedy, EOS ignored, default buckets), and classes every round dispatch by what happened since the
previous one; per class: how many, and the host ms inside the call (p50 / mean), against the clean rounds
(nothing in between, same bucket and tier).

    python bench/probes/round_events.py --prompts .data/mtbench.jsonl --batch 16 --waves 5 \\
        --modes static,continuous [--adaptive '{"policy": "throughput"}'] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import chat_ids, device_kind, emit, git_commit, read_prompts  # noqa: E402


class Recorder:
    """Wraps one engine's decoder methods (instance attributes: the class is untouched) and records,
    per round dispatch, the call's host ms, its (bucket, KV bucket, tier) and the events since the last."""

    def __init__(self, eng):
        self.dec, self.on, self.events, self.rows, self.last = eng.decoder, False, [], [], None
        for name in ("prefill", "read_tables", "assign_slots"):
            setattr(self.dec, name, self._marked(name, getattr(self.dec, name)))
        self.dec.step = self._timed(self.dec.step)

    def _marked(self, name, fn):
        def call(*a, **k):
            if self.on:
                self.events.append(name)
            return fn(*a, **k)
        return call

    def _timed(self, fn):
        def call(reqs, b, kv, drain=None):
            ctl = getattr(self.dec, "controller", None)
            tier = ctl.active_index if ctl is not None else 0
            t0 = time.perf_counter()
            out = fn(reqs, b, kv, drain)
            ms = (time.perf_counter() - t0) * 1e3
            if self.on:
                key = (b, kv, tier)
                why = sorted(set(self.events))
                if self.last is not None and key != self.last:
                    why += [w for w, same in (("bucket", key[:1] == self.last[:1]), ("kv", key[1] == self.last[1]),
                                              ("tier", key[2] == self.last[2])) if not same]
                self.rows.append(("+".join(why) or "clean", ms))
                self.last, self.events = key, []
            return out
        return call

    def start(self):
        self.on, self.events, self.last = True, [], None


def summary(rows) -> dict:
    by = defaultdict(list)
    for why, ms in rows:
        by[why].append(ms)
    clean = statistics.median(by["clean"]) if by.get("clean") else None
    out = {}
    for why, v in sorted(by.items(), key=lambda kv: -len(kv[1])):
        out[why] = {"n": len(v), "p50_ms": round(statistics.median(v), 3), "mean_ms": round(statistics.fmean(v), 3),
                    "excess_ms": round(sum(v) - clean * len(v), 1) if clean is not None else None}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--waves", type=int, default=5)
    p.add_argument("--modes", default="static,continuous")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=2, help="timed runs per mode (their rounds pooled)")
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--adaptive", default=None, metavar="JSON", help="an adaptive engine (AdaptiveConfig JSON)")
    p.add_argument("--engine-config", default=None, metavar="JSON", help="EngineConfig overrides")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    from jeagle.speculative.adaptive import AdaptiveConfig
    from jeagle.loading.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative
    from jeagle.loading.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig
    from jeagle.loading.tokenizer import Tokenizer

    target_dir = resolve_target(None, quiet=True)
    model = load_model(target_dir)
    head = load_draft(resolve_draft(str(default_head_dir()), target_dir, quiet=True), target=model.cfg)
    ids = chat_ids(Tokenizer.from_dir(target_dir), read_prompts(args.prompts, ""))
    prompts = [ids[i % len(ids)] for i in range(args.batch * args.waves)]
    ec = EngineConfig(max_batch_size=args.batch, max_context=max(map(len, prompts)) + args.max_new_tokens + 16,
                      kernels=KernelSettings.from_env(), **json.loads(args.engine_config or "{}"))
    adaptive = AdaptiveConfig.from_dict(json.loads(args.adaptive)) if args.adaptive else None
    eng = speculative(model, head, ec, SpecConfig(*map(int, args.tier.split(","))), adaptive=adaptive)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    eng.warmup(batch_sizes=range(1, args.batch + 1), prefill_lengths=sorted({len(x) for x in prompts}),
               greedy=(True,), prefix=(False, True), progress=False)
    rec = Recorder(eng)
    doc = {"probe": "round_events", "device": device_kind(), "commit": git_commit(), "batch": args.batch,
           "waves": args.waves, "adaptive": args.adaptive, "modes": {}}
    for mode in args.modes.split(","):
        eng.max_running = args.batch if mode == "continuous" else eng.decoder.max_reqs
        runs = [prompts] if mode == "continuous" else [prompts[i:i + args.batch]
                                                      for i in range(0, len(prompts), args.batch)]
        for w in runs:  # warm run
            eng.generate(w, sp)
        rec.rows, walls, rounds = [], [], 0
        for _ in range(args.runs):
            eng.flush_cache()
            if adaptive is not None:
                eng.decoder.reset_tier()
            rec.start()
            t0 = time.perf_counter()
            for w in runs:
                eng.generate(w, sp)
                rounds += eng.last_stats.steps
                if eng.last_stats.compile_s:
                    raise RuntimeError(f"{mode}: a timed run compiled")
            walls.append(time.perf_counter() - t0)
            rec.on = False
        s = summary(rec.rows)
        doc["modes"][mode] = {"wall_s": [round(w, 3) for w in walls], "rounds": rounds,
                              "ms_per_round": round(1e3 * sum(walls) / max(rounds, 1), 3),
                              "call_ms_total": round(sum(ms for _, ms in rec.rows), 1), "classes": s}
        print(f"== {mode}: {rounds} rounds in {args.runs} runs, {doc['modes'][mode]['ms_per_round']} ms a round, "
              f"host in the round calls {doc['modes'][mode]['call_ms_total']} ms")
        for why, c in s.items():
            print(f"  {why:<40} n {c['n']:>5}  call p50 {c['p50_ms']:>7.3f}  mean {c['mean_ms']:>7.3f} ms"
                  f"  excess over clean {c['excess_ms']} ms")
    emit(doc, args.json_out)


if __name__ == "__main__":
    main()
