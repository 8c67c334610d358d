"""Issue 22: what a prefill call costs the host under continuous batching, idle vs behind a round in flight.

bench/decode.py --continuous (bench/HISTORY.md session 38) ran EAGLE at batch 16 / 48 slower than static
waves although it needed fewer rounds: each admission is a prefill call of its own, and served steps
measured 2.8-3.5 ms of host time per EAGLE prefill call (session 31). This probe asks whether that time is
launching (the same whatever the device is doing) or waiting (the call returns only once the device has
caught up: it then grows by the round in flight):

    idle   one short request at a time on an idle engine: the prefill call's host time
    busy   `--batch` - 1 long requests running, one short request admitted at a time between their
           rounds (its prefill call dispatched behind the round in flight)

For each engine (`--systems`: target-only, EAGLE (5,4,8)), random SmolLM2-shaped weights: the engine's own
per-call counter (`host_totals`: prefills, prefill_dispatch_s), median over `--calls` admissions; and
the `while` loops in the compiled prefill executables (a while loop whose trip count XLA does not know
reads its predicate back to the host every iteration). CPU runs check the code only.

    python bench/probes/prefill_call.py --calls 20
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, git_commit, random_target_and_head  # noqa: E402


def while_loops(hlo: str) -> dict:
    """The compiled module's while loops: how many, and how many carry a known trip count."""
    loops = [line for line in hlo.splitlines() if re.search(r"\swhile\(", line)]
    known = [line for line in loops if "known_trip_count" in line]
    return {"while": len(loops), "known_trip_count": len(known)}


def prefill_ms(eng) -> tuple[int, float]:
    t = eng.host_totals
    return t["prefills"], t["prefill_dispatch_s"]


def measure(eng, short, long_prompts, calls: int, busy: bool) -> list[float]:
    """Host ms of each admitted short request's prefill call."""
    from jeagle.sampling import SamplingParams

    one = SamplingParams(max_new_tokens=2, ignore_eos=True)
    runners = []
    if busy:
        runners = [eng.submit(p, SamplingParams(max_new_tokens=100_000, ignore_eos=True)) for p in long_prompts]
        for _ in range(4):  # every long request admitted and running
            eng.step()
    out = []
    for i in range(calls):
        n0, s0 = prefill_ms(eng)
        r = eng.submit(short[i % len(short)], one)
        while not r.done:
            eng.step()
        n1, s1 = prefill_ms(eng)
        if n1 - n0 == 1:
            out.append(1e3 * (s1 - s0))
        if not busy:
            time.sleep(0.005)  # the device idle before the next one
    for x in runners:
        eng.abort(x)
    while eng.has_work:
        eng.step()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=60, help="short requests' prompt tokens")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--systems", default="target,eagle")
    p.add_argument("--engine-config", default=None, metavar="JSON", help="EngineConfig overrides")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import numpy as np

    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.spec.round import SpecConfig

    model, head = random_target_and_head(args.shape)
    rng = np.random.default_rng(0)
    short = [list(rng.integers(10, model.cfg.vocab_size, args.prompt)) for _ in range(8)]
    long_prompts = [list(rng.integers(10, model.cfg.vocab_size, args.prompt)) for _ in range(args.batch - 1)]
    cfg = EngineConfig(max_batch_size=args.batch, max_context=4096, prefix_cache=False,
                       kernels=KernelSettings.from_env(), **json.loads(args.engine_config or "{}"))
    doc = {"bench": "prefill_call", "shape": args.shape, "device": device_kind(), "commit": git_commit(),
           "batch": args.batch, "prompt": args.prompt, "engine_config": args.engine_config, "rows": []}
    for system in args.systems.split(","):
        eng = target_only(model, cfg) if system == "target" else speculative(model, head, cfg, SpecConfig(5, 4, 8))
        eng.warmup(batch_sizes=range(1, args.batch + 1), prefill_lengths=[args.prompt], greedy=(True,), progress=False)
        row = {"system": system}
        for mode in ("idle", "busy"):
            measure(eng, short, long_prompts, 3, mode == "busy")  # anything left to load or prime
            ms = measure(eng, short, long_prompts, args.calls, mode == "busy")
            row[f"{mode}_prefill_call_ms_p50"] = round(statistics.median(ms), 3) if ms else None
            row[f"{mode}_calls"] = len(ms)
        key = eng.decoder.prefill_key(*eng.buckets.prefill(1, args.prompt))  # the short requests' prefill
        row["prefill_while_loops"] = loops = while_loops(eng.decoder.executables.get(key).as_text())
        print(f"{system}: prefill call host ms p50 idle {row['idle_prefill_call_ms_p50']} / busy "
              f"{row['busy_prefill_call_ms_p50']} ({row['busy_calls']} calls); while loops in its prefill: "
              f"{json.dumps(loops)}", flush=True)
        doc["rows"].append(row)
    text = json.dumps(doc)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
