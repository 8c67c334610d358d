"""What `--deterministic` costs: tokens/s of the default and the deterministic mode in one process, random
weights of a real model's shape (a step's cost depends on shapes, not weights), target-only and EAGLE (5,4,8)
with a simulated accept length, at each batch size; each after a warm-up, the median of `--repeats` runs.

    python bench/probes/deterministic_cost.py --shape smollm2 --batch-sizes 1,16 --json-out cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import device_kind, emit, git_commit, random_target_and_head  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tau", type=float, default=3.2, help="simulated accept length of the EAGLE runs")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default="target-only,eagle")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import numpy as np

    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig

    model, head = random_target_and_head(args.shape)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    ctx = args.prompt_len + args.max_new_tokens + 32
    rows, doc = [], {"probe": "deterministic_cost", "commit": git_commit(), "device": device_kind(),
                     "shape": args.shape, "tau": args.tau, "prompt_len": args.prompt_len,
                     "max_new_tokens": args.max_new_tokens}
    base = KernelSettings.from_env()
    for bs in (int(x) for x in args.batch_sizes.split(",")):
        rng = np.random.default_rng(bs)
        prompts = [[int(t) for t in rng.integers(5, model.cfg.vocab_size, size=args.prompt_len)] for _ in range(bs)]
        for system in args.systems.split(","):
            tps = {}
            for mode in ("default", "deterministic"):
                ec = EngineConfig(max_batch_size=bs, max_context=ctx,
                                  kernels=dataclasses.replace(base, deterministic=mode == "deterministic"))
                eng = (target_only(model, ec) if system == "target-only"
                       else speculative(model, head, ec, SpecConfig(5, 4, 8), simulate_accept=args.tau))
                eng.warmup_for([args.prompt_len] * bs, sp.max_new_tokens, greedy=(True,), progress=False)
                eng.generate(prompts, sp)
                walls = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    outs = eng.generate(prompts, sp)
                    walls.append(time.perf_counter() - t0)
                tps[mode] = sum(len(o.token_ids) for o in outs) / sorted(walls)[len(walls) // 2]
            row = {"batch": bs, "system": system, "default_tok_s": tps["default"],
                   "deterministic_tok_s": tps["deterministic"], "cost": tps["default"] / tps["deterministic"]}
            rows.append(row)
            print(f"{args.shape} batch {bs:3d} {system:11s}: default {tps['default']:10.1f} tok/s, deterministic "
                  f"{tps['deterministic']:10.1f} tok/s, cost {row['cost']:.3f}x", flush=True)
    doc["rows"] = rows
    emit(doc, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
