"""Cost of one speculative round: one fused executable vs two (draft + tree | verify + commit + extend).

Random weights of a named shape with a random EAGLE-1 head (acceptance does not change what a round
computes, only how many tokens it yields), greedy unless `--temperature`, warm. Measures wall time per round over
`--rounds` rounds of a batch, and the target-only decode step in the same run for scale. Prints a
table, then one JSON line.

    python bench/probes/spec_round.py --shape smollm2 --batch-sizes 1,16 --tiers 5,4,8:3,1,4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, git_commit, random_target_and_head  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tiers", default="5,4,8:3,1,4")
    p.add_argument("--rounds", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled rounds (the sampling walk)")
    p.add_argument("--rounds-as", default="fused,split", help="fused (one executable), split (two), or both")
    args = p.parse_args(argv)

    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig

    model, head = random_target_and_head(args.shape)
    kernels = KernelSettings.from_env()  # JEAGLE_KERNELS, JEAGLE_XLA_OPTIONS, ...: read once, here
    prompt = list(range(100, 100 + args.context))
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        sp = SamplingParams(max_new_tokens=args.rounds, ignore_eos=True, temperature=args.temperature, seed=0)
        ar = target_only(model, EngineConfig(max_batch_size=batch, max_context=1024, kernels=kernels))
        ar.generate([prompt] * batch, sp)
        t0 = time.perf_counter()
        ar.generate([prompt] * batch, sp)
        ar_step = (time.perf_counter() - t0) / args.rounds
        for tier in args.tiers.split(":"):
            s, k, n = (int(x) for x in tier.split(","))
            for fused in [{"fused": True, "split": False}[x] for x in args.rounds_as.split(",")]:
                eng = speculative(model, head, EngineConfig(max_batch_size=batch, max_context=1024, kernels=kernels),
                                  SpecConfig(s, k, n), fused_round=fused)
                eng.generate([prompt] * batch, sp)
                t0 = time.perf_counter()
                eng.generate([prompt] * batch, sp)
                wall = time.perf_counter() - t0
                rounds = eng.last_stats.speculative.rounds / batch
                rows.append({"batch": batch, "tier": [s, k, n], "fused": fused, "rounds": rounds,
                             "temperature": args.temperature, "kernels": kernels.backend or "default",
                             "ms_per_round": round(1e3 * wall / rounds, 3), "target_decode_ms": round(1e3 * ar_step, 3),
                             "accept_length": round(eng.last_stats.accept_length, 3),
                             "compile_s": round(eng.compile_seconds, 1)})
    print(f"{'batch':>5} {'S,K,N':>8} {'round':>6} {'ms/round':>9} {'AR ms/step':>10} {'accept':>7} {'compile s':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {','.join(map(str, r['tier'])):>8} {'fused' if r['fused'] else 'split':>6} "
              f"{r['ms_per_round']:>9.3f} {r['target_decode_ms']:>10.3f} {r['accept_length']:>7.2f} {r['compile_s']:>9.1f}")
    print(json.dumps({"bench": "spec_round", "shape": args.shape, "device": device_kind(),
                      "commit": git_commit(), "rows": rows}))


if __name__ == "__main__":
    main()
