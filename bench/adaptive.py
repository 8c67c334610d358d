"""Adaptive tiers vs every static tier on a phased workload: tokens/s per phase and overall.

The workload alternates acceptance phases. No trained EAGLE head existed when this was written, so the
acceptance is made, not found: the target has SmolLM2's shapes (so every step costs what SmolLM2's
does) with its attention and MLP outputs zeroed and its lm_head a row permutation of its embedding,
which makes its next token a fixed permutation of the current one; a one-layer EAGLE-1 head whose fc maps the token embedding through (identity + noise)
then proposes that function with a chosen error rate. Between phases every engine gets the head
weights of the next phase (same graph, new values), in the same order:

    high   the noiseless head: the target's own next token at every depth (accepts everything)
    mid    fc noise --mid-noise: partial acceptance
    low    the sign-flipped head: never the target's token (accepts nothing)

Engines: one per static tier and one adaptive engine per policy of `--policies` (throughput: the
default, expected tokens per second from measured round times; ema: SGLang's) over the same tiers (one set of chain tiers
(K = 1, SGLang's restriction) and, with --tree-tiers, one set of tree tiers). All warm (every
executable compiled before timing), greedy, `--batch` requests of `--phase-tokens` new tokens per
phase, the whole phase sequence `--repeats` times (policy reset, engine order rotated each time):
per-phase figures are medians over the repeats, overall ones total tokens / total time. Prints a
table, then one JSON line.

    python bench/adaptive.py --phases high,low,mid,high,low --batch 1,16
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import device_kind, git_commit, phased_models


def tiers_arg(text: str):
    return tuple(tuple(int(x) for x in t.split(",")) for t in text.split(":"))


def set_head(engine, head_params) -> None:
    """Give a speculative engine's draft head new weights (same graph, so nothing recompiles): the
    decoder's params are the pair (target params, draft params)."""
    dec = engine.decoder
    dec.params = (dec.params[0], head_params)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2")
    p.add_argument("--phases", default="high,low,mid,high,low,mid")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated (each a separate workload)")
    p.add_argument("--phase-tokens", type=int, default=384, help="new tokens per request per phase")
    p.add_argument("--chain-tiers", type=tiers_arg, default=tiers_arg("1,1,2:3,1,4:7,1,8"))
    p.add_argument("--tree-tiers", type=tiers_arg, default=None, help="e.g. 1,4,3:3,4,8:6,4,16")
    p.add_argument("--mid-noise", type=float, default=0.02)
    p.add_argument("--adaptive-config", default=None, help="JSON file (default: the policy's defaults)")
    p.add_argument("--policies", default="throughput,ema", help="adaptive policies, one engine each")
    p.add_argument("--context", type=int, default=128, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=3, help="whole-workload repeats (per-phase figures: medians)")
    args = p.parse_args(argv)

    import numpy as np

    from jeagle.speculative.adaptive import AdaptiveConfig
    from jeagle.engine import EngineConfig, speculative
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig

    phases = args.phases.split(",")
    target, head_params, head = phased_models(args.shape, args.mid_noise)
    # The file's keys (each policy fills the ones it omits with its own defaults).
    adaptive_doc = json.loads(open(args.adaptive_config).read()) if args.adaptive_config else {}
    rng = np.random.default_rng(0)
    vocab = target.cfg.vocab_size
    tier_sets = {"chain": args.chain_tiers} | ({"tree": args.tree_tiers} if args.tree_tiers else {})
    rows, switches = [], {}
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = [list(rng.integers(10, vocab, args.context)) for _ in range(batch)]
        sp = SamplingParams(max_new_tokens=args.phase_tokens, ignore_eos=True)
        max_ctx = args.context + args.phase_tokens + 64
        ecfg = EngineConfig(max_batch_size=batch, max_context=max_ctx, batch_buckets=(batch,),
                            kernels=KernelSettings.from_env())
        for set_name, tiers in tier_sets.items():
            engines = {f"static {s},{k},{n}": speculative(target, head, ecfg, SpecConfig(s, k, n)) for s, k, n in tiers}
            mid = tiers[len(tiers) // 2]
            for policy in args.policies.split(","):
                ad = AdaptiveConfig.from_dict({**adaptive_doc, "candidate_tiers": tiers, "policy": policy})
                engines[f"adaptive {policy}"] = speculative(target, head, ecfg, SpecConfig(*mid), adaptive=ad)
            for name, eng in engines.items():
                t0 = time.perf_counter()
                eng.warmup(batch_sizes=[batch], prefill_lengths=[args.context], greedy=(True,), progress=False)
                # One untimed pass per phase kind, so every code path has run once (then reset the policy).
                for ph in sorted(set(phases)):
                    set_head(eng, head_params[ph])
                    eng.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
                eng.decoder.reset_tier()
                print(f"[{set_name} B={batch}] {name}: warm in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            for rep in range(args.repeats):
                for eng in engines.values():
                    eng.decoder.reset_tier()  # each repeat is the whole workload from the start
                order = list(engines.items())
                order = order[rep % len(order):] + order[: rep % len(order)]  # rotate: no engine always first
                for i, ph in enumerate(phases):
                    for name, eng in order:
                        set_head(eng, head_params[ph])
                        t0 = time.perf_counter()
                        outs = eng.generate(prompts, sp)
                        wall = time.perf_counter() - t0
                        st = eng.last_stats.to_dict()
                        assert st["compilations"] == 0, (name, st["compilations"])
                        first = max(o.time_to_first_token_s for o in outs)
                        rows.append({"batch": batch, "tiers": set_name, "engine": name, "repeat": rep, "phase_index": i,
                                     "phase": ph,
                                     "tokens": st["new_tokens"], "wall_s": round(wall, 4),
                                     "last_first_token_s": round(first, 4), "round_dispatches": st["round_dispatches"],
                                     "ms_per_round_after_first_token": round(1e3 * (wall - first) / st["round_dispatches"], 3),
                                     "host_blocked_ms": st["host_blocked_ms"],
                                     "tokens_per_s": round(st["new_tokens"] / wall, 1),
                                     "accept_length": round(st["accept_length"], 3),
                                     "tier_history": st["tier_history"] if eng.adaptive else None,
                                     "adaptive_state": st["adaptive_state"]})
            switches[f"{set_name} B={batch}"] = {n: e.decoder.controller.switches for n, e in engines.items()
                                                 if e.adaptive}

    # ---- summary: per phase and overall, adaptive against every static tier -----------------------------
    summary = []
    for key in sorted({(r["batch"], r["tiers"]) for r in rows}):
        sel = [r for r in rows if (r["batch"], r["tiers"]) == key]
        names = list(dict.fromkeys(r["engine"] for r in sel))
        adaptive = [n for n in names if n.startswith("adaptive")]
        static = [n for n in names if n not in adaptive]
        print(f"\nbatch {key[0]}, {key[1]} tiers: tokens/s (accept length); last columns: each adaptive engine / "
              "the best static tier")
        print(f"{'phase':>10} " + " ".join(f"{n:>20}" for n in names) + "".join(f" {n[9:] + '/best':>15}" for n in adaptive))
        for i, ph in enumerate(phases):
            # Median over repeats of each engine's tokens/s in this phase.
            by = {n: {"tokens_per_s": float(np.median([r["tokens_per_s"] for r in sel if r["phase_index"] == i
                                                         and r["engine"] == n])),
                      "accept_length": float(np.median([r["accept_length"] for r in sel if r["phase_index"] == i
                                                          and r["engine"] == n]))} for n in names}
            best = max(by[n]["tokens_per_s"] for n in static)
            ratios = {n: by[n]["tokens_per_s"] / best for n in adaptive}
            print(f"{i}:{ph:>8} " + " ".join(f"{by[n]['tokens_per_s']:>13.1f} ({by[n]['accept_length']:>4.2f})"
                                            for n in names) + "".join(f" {ratios[n]:>15.3f}" for n in adaptive))
            summary.append({"batch": key[0], "tiers": key[1], "phase_index": i, "phase": ph,
                            "adaptive_over_best": ratios, "median_tokens_per_s": {n: by[n]["tokens_per_s"] for n in names}})
        overall = {n: sum(r["tokens"] for r in sel if r["engine"] == n) / sum(r["wall_s"] for r in sel if r["engine"] == n)
                   for n in names}
        best = max(overall[n] for n in static)
        print(f"{'overall':>10} " + " ".join(f"{overall[n]:>20.1f}" for n in names)
              + "".join(f" {overall[n] / best:>15.3f}" for n in adaptive))
        summary.append({"batch": key[0], "tiers": key[1], "phase": "overall", "tokens_per_s": overall,
                        "adaptive_over_best": {n: overall[n] / best for n in adaptive}})
    print(json.dumps({"bench": "adaptive", "shape": args.shape, "device": device_kind(),
                      "commit": git_commit(), "phases": phases,
                      "phase_tokens": args.phase_tokens, "mid_noise": args.mid_noise,
                      "adaptive_config": adaptive_doc, "policies": args.policies.split(","), "switches_last_repeat": switches, "summary": summary,
                      "rows": rows}, default=list))


if __name__ == "__main__":
    main()
