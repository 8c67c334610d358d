"""Issue 22: the slot-table updates (`decoder.assign_slots`, each a dispatch between two rounds that stalls
the device, bench/HISTORY.md session 20) that static waves and continuous batching dispatch for the same
prompts: a count, not a time, so it runs on any backend.

bench/decode.py --continuous (session 39) still runs a round 0.5-0.7 ms slower than static waves with the
prefill calls grouped. Finished requests' KV stays in the prefix cache, so under continuous batching
admissions find fewer free slots, get a prompt and a chunk instead of a whole context, and grow on demand:
this counts how much more often. A tiny fp32 EAGLE engine (the test suite's bigram target and identity
head), `--prompts` prompts of 40-200 random tokens, `--new` tokens each, `--batch` rows:

    static      `--prompts` / `--batch` generate() calls, one wave each
    continuous  one generate() over all of them (at most `--batch` running)

    python bench/probes/slot_updates.py    # CPU: ~1 min
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jeagle.engine import EngineConfig, speculative  # noqa: E402
from jeagle.sampling import SamplingParams  # noqa: E402
from jeagle.spec.round import SpecConfig  # noqa: E402
from tests.spec_models import bigram_target, signed_identity_head, target_config  # noqa: E402


def run(mode: str, target, head, prompts, batch: int, new: int) -> dict:
    eng = speculative(target, head, EngineConfig(max_batch_size=batch, max_context=200 + new + 16),
                      SpecConfig(5, 4, 8))
    counts = {"slot_table_updates": 0, "rows_grown": 0}
    assign = eng.decoder.assign_slots

    def counted(entries):
        counts["slot_table_updates"] += 1
        counts["rows_grown"] += len(entries)
        return assign(entries)
    eng.decoder.assign_slots = counted
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    waves = [prompts[i:i + batch] for i in range(0, len(prompts), batch)] if mode == "static" else [prompts]
    rounds = calls = 0
    for wave in waves:
        eng.generate(wave, params)
        rounds += eng.last_stats.steps
        calls += eng.last_stats.prefill_calls
    return {"mode": mode, "rounds": rounds, "prefill_calls": calls, **counts, "evicted_slots": eng.kv.evicted_total,
            "pool_slots": eng.pool.num_slots - 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new", type=int, default=160)
    args = p.parse_args()
    target = bigram_target(target_config())
    head = signed_identity_head(target, +1.0, noise=0.08)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(4, 96, int(n))) for n in rng.integers(40, 200, args.prompts)]
    for mode in ("static", "continuous"):
        print(json.dumps(run(mode, target, head, prompts, args.batch, args.new)), flush=True)


if __name__ == "__main__":
    main()
