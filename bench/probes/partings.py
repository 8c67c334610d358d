"""Where greedy EAGLE parts from greedy target-only in bf16, how close a tie each parting is, and what
deterministic mode costs.

For each mode (the default, `--deterministic`): greedy target-only and greedy EAGLE (shipped head,
(5,4,8)) over the MT-bench first turns, `--max-new-tokens` each (EOS ignored), at batch 16 (all
prompts) and batch 1 (the first `--batch1-prompts`), warmed up, timed. Per request: whether the first
token and the whole output agree, the first parting index, and — from one fp32 forward over the
prompt and the common prefix — the fp32 logit gap between the two tokens the engines chose there.
A gap far under bf16's rounding of the logits (~0.05 here) means a near tie, not a lossless bug.

    python bench/probes/partings.py --prompts .data/mtbench.jsonl --json-out partings.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import chat_ids, device_kind, emit, git_commit, prompt_logits, read_prompts  # noqa: E402


def fp32_gap(model, ids: list[int], a: int, b: int) -> float:
    """logit(a) - logit(b) after `ids`, from one fp32 prefill-shaped forward."""
    lg = prompt_logits(model, ids)
    return float(lg[a] - lg[b])


def timed(engine, prompts, sp):
    engine.warmup_for([len(p) for p in prompts], sp.max_new_tokens, greedy=(True,), progress=False)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    wall = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    stats = engine.last_stats.to_dict()
    return [o.token_ids for o in outs], {"tokens_per_second": n / wall, "new_tokens": n,
                                         "accept_length": stats.get("accept_length")}


def compare(prompts, want, got, fp32):
    rows = []
    for i, (a, b) in enumerate(zip(want, got)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"prompt": i, "equal": a == b, "first_token_equal": a[0] == b[0], "parts_at": at}
        if at is not None:
            row["gap_fp32"] = fp32_gap(fp32, prompts[i] + a[:at], a[at], b[at])
        rows.append(row)
    gaps = sorted(abs(r["gap_fp32"]) for r in rows if "gap_fp32" in r)
    return {"requests": len(rows), "equal": sum(r["equal"] for r in rows),
            "first_token_equal": sum(r["first_token_equal"] for r in rows),
            "partings": len(gaps), "gap_fp32_abs_max": gaps[-1] if gaps else None,
            "gap_fp32_abs_median": gaps[len(gaps) // 2] if gaps else None,
            "gaps_below_0.05": sum(g < 0.05 for g in gaps), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=".data/mtbench.jsonl")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--batch1-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--modes", default="default,deterministic")
    p.add_argument("--batch-sizes", default="16,1",
                   help="comma list; batch 1 takes the first --batch1-prompts prompts, batch B > 1 the first B (one wave)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import dataclasses

    from jeagle.loading.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.loading.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig
    from jeagle.loading.tokenizer import Tokenizer

    target_dir = resolve_target(None, dtype="bfloat16", quiet=True)
    head_dir = resolve_draft(str(default_head_dir()), target_dir, dtype="bfloat16", quiet=True)
    tok = Tokenizer.from_dir(target_dir)
    prompts = chat_ids(tok, read_prompts(args.prompts, "Write a short story about a robot.")[:args.num_prompts])
    model = load_model(target_dir, dtype="bfloat16")
    head = load_draft(head_dir, target=model.cfg, dtype="bfloat16")
    fp32 = load_model(target_dir, dtype="float32")
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    ctx = max(map(len, prompts)) + args.max_new_tokens + 16
    doc = {"probe": "partings", "commit": git_commit(), "device": device_kind(), "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "tier": [5, 4, 8], "modes": {}}
    base = KernelSettings.from_env()
    for mode in args.modes.split(","):
        ks = dataclasses.replace(base, deterministic=mode == "deterministic")
        out = {}
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            ps = prompts[:args.batch1_prompts] if bs == 1 else prompts[:bs]
            ec = EngineConfig(max_batch_size=bs, max_context=ctx, kernels=ks)
            want, t_stats = timed(target_only(model, ec), ps, sp)
            got, s_stats = timed(speculative(model, head, ec, SpecConfig(5, 4, 8)), ps, sp)
            cmp = compare(ps, want, got, fp32)
            out[f"batch{bs}"] = {"target_only": t_stats, "eagle": s_stats,
                                 "speedup": s_stats["tokens_per_second"] / t_stats["tokens_per_second"]} | cmp
            print(f"{mode} batch {bs}: target-only {t_stats['tokens_per_second']:.1f} tok/s, EAGLE "
                  f"{s_stats['tokens_per_second']:.1f} tok/s (accept {s_stats['accept_length']}); equal "
                  f"{cmp['equal']}/{cmp['requests']}, first token equal {cmp['first_token_equal']}, partings "
                  f"{cmp['partings']}, |fp32 gap| max {cmp['gap_fp32_abs_max']} median {cmp['gap_fp32_abs_median']}, "
                  f"< 0.05: {cmp['gaps_below_0.05']}", flush=True)
            if bs == 16:
                out["target_only_batch16_tokens"] = want  # cross-mode comparison below
        doc["modes"][mode] = out
    if {"default", "deterministic"} <= set(doc["modes"]):
        a = doc["modes"]["default"].pop("target_only_batch16_tokens")
        b = doc["modes"]["deterministic"].pop("target_only_batch16_tokens")
        doc["target_only_default_vs_deterministic_equal"] = sum(x == y for x, y in zip(a, b))
    for m in doc["modes"].values():
        m.pop("target_only_batch16_tokens", None)
    emit(doc, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
