"""Where an adaptive engine's time goes, dispatch by dispatch (issue 22): SmolLM2 + the shipped head on
MT-bench first turns, one batch, the engine warmed like bench/decode.py; every round dispatch logged with
its tier and bucket and the wall time from the previous result to its own. Prints per (tier, batch
bucket) the rounds and their median / mean / max gap, and the largest gaps with what ran.

    python bench/probes/adaptive_rounds.py --prompts .data/mtbench.jsonl --batch 16 --adaptive '{"policy": "throughput"}'
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sched_wait_s() -> float:
    """Seconds the main thread has waited on a run queue (runnable, not running): /proc/self/schedstat."""
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def steal_s() -> float:
    """Seconds of the machine's CPUs' time taken by its hypervisor (/proc/stat steal, all CPUs summed)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--adaptive", default=None, metavar="JSON", help="AdaptiveConfig fields; none: static --tier")
    p.add_argument("--tier", default="5,4,8")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--engine-config", default=None, metavar="JSON",
                   help="EngineConfig fields on top of the probe's (e.g. executable_cache_dir: later processes load "
                        "what earlier ones compiled)")
    args = p.parse_args(argv)

    from jeagle.adaptive import AdaptiveConfig
    from jeagle.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative
    from jeagle.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig
    from jeagle.tokenizer import Tokenizer

    from decode import chat_ids, read_prompts

    target_dir = resolve_target(None, quiet=True)
    head_dir = resolve_draft(str(default_head_dir()), target_dir, quiet=True)
    ids = chat_ids(Tokenizer.from_dir(target_dir), read_prompts(args.prompts, ""))[: args.batch]
    model = load_model(target_dir)
    head = load_draft(head_dir, target=model.cfg)
    ec = EngineConfig(**{"max_batch_size": args.batch, "max_context": max(map(len, ids)) + args.max_new_tokens + 16,
                         "kernels": KernelSettings.from_env(), **json.loads(args.engine_config or "{}")})
    adaptive = AdaptiveConfig.from_dict(json.loads(args.adaptive)) if args.adaptive else None
    eng = speculative(model, head, ec, SpecConfig(*map(int, args.tier.split(","))), adaptive=adaptive)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    eng.warmup(batch_sizes=range(1, args.batch + 1), prefill_lengths=sorted({len(x) for x in ids}), greedy=(True,),
               prefix=(False, True), progress=False)
    eng.generate(ids, sp)
    dec = eng.decoder
    log = []  # (kind, tier index, batch, kv, time)
    inflight = collections.deque()  # (tier index, batch, kv) of the dispatched, unread rounds
    step, unpack, calibrate = dec.step, dec.unpack, dec.calibrate
    host = collections.Counter()  # seconds inside the decoder's step / unpack / the controller / calibrate

    def step_logged(reqs, b, kv, drain=None):
        ran = dec.controller.active_index if dec.controller is not None else 0  # the tier this dispatch runs
        t = time.perf_counter()
        out = step(reqs, b, kv, drain)
        host["step"] += time.perf_counter() - t
        inflight.append((ran, b, kv))
        log.append(("dispatch", ran, b, kv, time.perf_counter()))
        return out

    def unpack_logged(kind, reqs, host_array):
        if kind == "step":
            ran, b, kv = inflight.popleft()
            log.append(("result", ran, b, kv, time.perf_counter()))
        t = time.perf_counter()
        out = unpack(kind, reqs, host_array)
        host["unpack"] += time.perf_counter() - t
        return out

    def calibrate_logged(*a, **k):
        t = time.perf_counter()
        calibrate(*a, **k)
        host["calibrate"] += time.perf_counter() - t
        host["calibrations"] += 1

    dec.step, dec.unpack, dec.calibrate = step_logged, unpack_logged, calibrate_logged
    if dec.controller is not None:
        verify = dec.controller.on_verify_complete

        def verify_logged(*a, **k):
            t = time.perf_counter()
            out = verify(*a, **k)
            host["controller"] += time.perf_counter() - t
            return out

        dec.controller.on_verify_complete = verify_logged
    gcs = collections.Counter()  # garbage collections by generation, while a run is timed
    gc.callbacks.append(lambda phase, info: phase == "start" and gcs.update([info["generation"]]))
    for run in range(args.runs):
        log.clear()
        inflight.clear()
        host.clear()
        gcs.clear()
        eng.flush_cache()
        if dec.controller is not None:
            dec.reset_tier()
        ru0, cpu0, th0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.thread_time()
        sched0, steal0 = sched_wait_s(), steal_s()
        t0 = time.perf_counter()
        outs = eng.generate(ids, sp)
        wall = time.perf_counter() - t0
        ru1, cpu1, th1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.thread_time()
        sched1, steal1 = sched_wait_s(), steal_s()
        blocked = eng.last_stats.host_blocked_ms or {}
        # A slow run that is host work shows as CPU seconds; one that waits (device, other processes)
        # as wall without them; switches and collections say what interrupted the thread.
        print(f"run {run} process: cpu {cpu1 - cpu0:.3f} s (main thread {th1 - th0:.3f}), wall {wall:.3f} s, "
              f"context switches {ru1.ru_nvcsw - ru0.ru_nvcsw} voluntary / {ru1.ru_nivcsw - ru0.ru_nivcsw} "
              f"involuntary, gc {dict(gcs)}, host blocked per step mean {blocked.get('mean', 0):.3f} ms "
              f"p99 {blocked.get('p99', 0):.3f}, main thread runnable but not running {(sched1 - sched0) * 1e3:.1f} ms, "
              f"machine steal {(steal1 - steal0) * 1e3:.0f} ms, {len(os.listdir('/proc/self/task'))} OS threads",
              flush=True)
        n = sum(len(o.token_ids) for o in outs)
        res = [e for e in log if e[0] == "result"]
        gaps = collections.defaultdict(list)
        worst = []
        for prev, cur in zip(res, res[1:]):
            g = (cur[4] - prev[4]) * 1e3
            gaps[dec.tiers[cur[1]].shape, cur[2]].append(g)
            worst.append((g, dec.tiers[cur[1]].shape, cur[2], cur[3], dec.tiers[prev[1]].shape))
        print(f"run {run}: {n} tokens in {wall:.3f} s = {n / wall:.1f} tok/s, {len(res)} rounds, "
              f"{eng.last_stats.speculative.accept_length:.3f} accepted; host ms in "
              + ", ".join(f"{k} {v * 1e3:.1f}" if k != "calibrations" else f"{k} {v}" for k, v in host.items()),
              flush=True)
        for (shape, b), g in sorted(gaps.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
            print(f"  tier {shape} batch {b}: {len(g)} rounds, gap median {statistics.median(g):.3f} mean "
                  f"{statistics.fmean(g):.3f} max {max(g):.3f} ms, sum {sum(g):.1f} ms")
        print("  largest gaps (ms, tier, batch, kv, previous tier):",
              [(round(g, 2), s, b, kv, ps) for g, s, b, kv, ps in sorted(worst, reverse=True)[:8]])
        if dec.controller is not None:
            print("  state:", json.dumps(dec.adaptive_state()))


if __name__ == "__main__":
    main()
