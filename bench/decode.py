"""Decode throughput of the real model, jeagle target-only vs jeagle EAGLE-3 vs peers, per batch size.

What is timed, for every system alike: greedy generation of `--max-new-tokens` tokens per request (EOS
ignored: every request gets exactly that many) for a batch of `batch` MT-bench first turns (chat
template applied, the same token ids for every system), after a warm-up run of the same batch that
compiles everything the timed run uses; tokens/s = batch × new tokens ÷ wall time (prefill included),
the median of `--repeats`. `--waves W` times W batches of distinct prompts one after another (batch 1
with one prompt says little about a head; `--waves 8` runs the first 8 prompts one at a time). `--continuous`
gives the same W × batch prompts to one `generate()` with at most `batch` requests running: a row that
finishes takes the next prompt at once (continuous batching, as SGLang's offline throughput bench runs a
`--max-running-requests`); without it a static batch lasts as long as its slowest row. Systems:

    jeagle        target-only (`target_only`)
    jeagle-eagle  EAGLE-3 with the shipped head (`speculative`, `--tier`, default (5,4,8)); its accept
                  length is reported
    jeagle-adaptive  the same head with the adaptive controller (`--speculative-adaptive`: the default
                  tiers for the base `--tier`, or `--adaptive-config`); the accept length and the tiers
                  it ran (round counts per tier) are reported
    hf            Hugging Face transformers `generate` with a static cache, its decode compiled by
                  transformers (`CompileConfig`: torch.compile reduce-overhead, fullgraph) on the same
                  GGUF dequantised to bf16 — needs torch + CUDA; left padding with an attention mask;
                  `min_new_tokens` forces the length
    eagle-llm     not run here: the official EAGLE code (`eagle-llm==1.2.1`, `eagle.model.cnets.Model`) is an
                  EAGLE-1/2 head (fc over [embedding | feature], the target's lm_head); the shipped head
                  is EAGLE-3 (low|mid|high features, its own 8k-vocabulary lm_head, d2t), which that code
                  cannot load. Printed as such in the JSON (`peers_not_run`); bench/eagle_llm_peer.py runs
                  it against jeagle on one EAGLE-1 head instead.

Every jeagle system's row says how many requests produced exactly target-only's tokens and the shortest
common prefix (greedy speculation is lossless; in bf16 the verify's different batch shape can part from
target-only at a near tie). `--engine-config JSON` sets more EngineConfig fields for every jeagle system.
`--buckets default` gives the engines the batch buckets a user gets (SGLang's list up to the largest
batch: a batch whose requests finish at different rounds shrinks into the next smaller one); `batches`
(the default until 2026-11-26) makes the timed batch sizes the only buckets (fewer executables to
compile; a speculative batch's last rounds then run at the full bucket until 16 or 1 rows remain).

Prints a table, writes `--plot` (tokens/s vs batch, one line per system and bucket rule; needs
matplotlib, else skipped with a message — `--plot-only JSON` draws it later), and prints one JSON line
last.

    python bench/decode.py --prompts .data/mtbench.jsonl --batch-sizes 1,4,16,48 --hf-batch-sizes 1,16 \
        --json-out decode.json --plot decode.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
from pathlib import Path

from common import chat_ids, device_kind, emit, git_commit, median_run, median_runs, plain_hf_model, read_prompts

EAGLE_LLM_WHY = ("eagle-llm 1.2.1 (eagle.model.cnets.Model) implements EAGLE-1/2 heads (fc over [embedding | "
                 "feature], the target's lm_head); the shipped head is EAGLE-3 (three-layer features, own "
                 "8k-vocabulary lm_head, d2t), which it cannot load")


def batch_of(prompts_ids: list[list[int]], batch: int, wave: int = 0) -> list[list[int]]:
    """Wave `wave`'s `batch` prompts: the first `batch` for wave 0, the next `batch` for wave 1, ... (cycled
    when there are fewer)."""
    return [prompts_ids[(wave * batch + i) % len(prompts_ids)] for i in range(batch)]


WAVE_SUMS = ("rounds", "round_dispatches", "steps", "wall_s", "new_tokens", "prompt_tokens", "grammar_mask_ms",
             "grammar_rows_walked", "grammar_rows_masked", "prefill_calls", "admission_held_steps")


def merge_waves(stats: list[dict]) -> dict:
    """One run's stats over its waves: the counters and times summed, tokens listed wave after wave, the
    accept length weighted by each wave's request-rounds, the round dispatches per tier summed over the
    waves' tier histories; the rest (latencies, tier history itself) the last wave's."""
    out = dict(stats[-1]) | {k: sum(s[k] for s in stats) for k in WAVE_SUMS}
    out["tokens"] = [t for s in stats for t in s["tokens"]]
    per_tier: dict[str, int] = {}
    for s in stats:  # each wave's history counts from its own first dispatch
        for key, n in tier_rounds(s).items():
            per_tier[key] = per_tier.get(key, 0) + n
    out["dispatches_per_tier"] = per_tier
    rounds = out["rounds"]
    out["accept_length"] = sum(s["accept_length"] * s["rounds"] for s in stats) / rounds if rounds else 1.0
    return out


JEAGLE_SYSTEMS = ("jeagle", "jeagle-eagle", "jeagle-adaptive")


def tier_rounds(stats: dict) -> dict:
    """{"S,K,N": round dispatches} from a speculative engine's last_stats (its tier_history:
    {first dispatch index: [S, K, N]} and round_dispatches)."""
    hist = sorted((int(i), t) for i, t in (stats.get("tier_history") or {}).items())
    out: dict[str, int] = {}
    for j, (start, t) in enumerate(hist):
        end = hist[j + 1][0] if j + 1 < len(hist) else stats.get("round_dispatches", start)
        key = ",".join(str(x) for x in t)
        out[key] = out.get(key, 0) + end - start
    return out


def token_agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    """How many requests equal target-only's tokens, and the shortest common prefix (bf16 greedy output
    may part at a near tie: the target's two best logits within rounding of each other)."""
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(got, want)]
    same = sum(a == b for a, b in zip(got, want))
    return {"same_tokens_as_target_only": f"{same}/{len(want)}", "shortest_common_prefix": min(prefixes)}


def jeagle_rows(target_dir, head_dir, prompts_ids, batches, max_new, repeats, tier, systems=JEAGLE_SYSTEMS,
                adaptive_config=None, engine_config: dict | None = None, sampling: dict | None = None,
                tokenizer=None, kv_chunk: int | None = None, waves: int = 1, buckets: str = "default",
                continuous: bool = False, freeze: bool = False, shrink_ratios=None) -> list[dict]:
    from jeagle.speculative.adaptive import AdaptiveConfig
    from jeagle.loading.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.settings import KernelSettings
    from jeagle.runtime.gc_clock import freeze_heap, gc_totals
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig

    model = load_model(target_dir)
    head = load_draft(head_dir, target=model.cfg)
    longest = max(len(p) for p in prompts_ids)
    # The kernel settings come from the environment (JEAGLE_KERNELS, JEAGLE_PAGED_ATTENTION_SPLITS, ...).
    ec = EngineConfig(max_batch_size=max(batches),
                      batch_buckets=tuple(sorted(set(batches))) if buckets == "batches" else None,
                      max_context=longest + max_new + 16, kernels=KernelSettings.from_env(), **(engine_config or {}))
    adaptive = AdaptiveConfig.from_json(adaptive_config) if adaptive_config else AdaptiveConfig()
    make = {"jeagle": lambda: target_only(model, ec),
            "jeagle-eagle": lambda: speculative(model, head, ec, SpecConfig(*tier)),
            "jeagle-adaptive": lambda: speculative(model, head, ec, SpecConfig(*tier), adaptive=adaptive)}
    engines = {name: make[name]() for name in systems}
    if kv_chunk:
        for eng in engines.values():
            eng.kv.chunk = kv_chunk  # positions a request's slots grow by ahead of need (runtime/kv.py)
    report = dict(sampling or {})
    sampling = dict(report)
    if "logit_bias" in sampling:
        sampling["logit_bias"] = tuple((int(k), float(v)) for k, v in sampling["logit_bias"].items())
    if "grammar" in sampling:  # [kind, source]: structured output; the requests then end at the grammar's EOS
        from jeagle.sampling.grammar import GrammarBackend

        kind, source = sampling["grammar"]
        sampling["grammar"] = GrammarBackend(tokenizer, model.cfg.vocab_size, model.cfg.eos_token_ids[0]).compile(
            kind, source)
        sampling.setdefault("ignore_eos", False)
    sp = SamplingParams(max_new_tokens=max_new, **({"ignore_eos": True} | sampling))
    rows = []
    for batch in batches:
        wave_ids = [batch_of(prompts_ids, batch, w) for w in range(waves)]
        ids = [p for w in wave_ids for p in w]
        tokens: dict[tuple, list[list[int]]] = {}
        first = len(rows)
        for name, eng in engines.items():
            # Compile every executable this batch can reach (the smaller buckets it shrinks into as
            # requests finish, every KV bucket, every tier of jeagle-adaptive; a grammar's rounds), then a
            # warm-up run. (A grammar's requests end at EOS, raggedly: without its executables compiled
            # here, a timed run could reach a bucket the warm-up run did not.)
            eng.warmup(batch_sizes=range(1, batch + 1), prefill_lengths=sorted({len(p) for p in ids}),
                       greedy=(sp.greedy,), logprobs=(sp.logprobs is not None,), penalties=(sp.penalized,),
                       grammar=(sp.grammar is not None,), prefix=(False, True), progress=False)
            # --continuous: every wave's prompts in one generate(), at most `batch` of them running at once
            eng.max_running = batch if continuous else eng.decoder.max_reqs
            runs = [ids] if continuous else wave_ids
            for w in runs:
                eng.generate(w, sp)
            if freeze:  # --freeze-heap: as a server does once its engine is built (jeagle/runtime/gc_clock.py)
                freeze_heap()
            gcs = {}  # per run: Python's garbage collections during it (ms, collections, full collections)

            def once(ratio):
                if ratio is not None:  # --bucket-shrink-ratios: the same engine, another bucket rule
                    eng.bucket_shrink_ratio = ratio
                eng.flush_cache()  # every run starts cold: later waves reuse only what this run prefilled
                if name == "jeagle-adaptive":
                    eng.decoder.reset_tier()  # every run starts from the initial tier with a fresh EMA
                n, stats, g0 = 0, [], gc_totals()
                for w in runs:  # --waves: batches of distinct prompts one after another
                    outs = eng.generate(w, sp)
                    if eng.last_stats.compile_s:
                        raise RuntimeError(f"{name}: the timed run compiled")
                    n += sum(len(o.token_ids) for o in outs)
                    stats.append(eng.last_stats.to_dict() | {"tokens": [o.token_ids for o in outs]})
                g1 = gc_totals()
                gcs.setdefault(ratio, []).append((round((g1["gc_s"] - g0["gc_s"]) * 1e3, 2),
                                                  g1["gc_collections"] - g0["gc_collections"],
                                                  g1["gc_full_collections"] - g0["gc_full_collections"]))
                return n, merge_waves(stats)

            ratios = shrink_ratios or [None]
            medians = median_runs({v: (lambda v=v: once(v)) for v in ratios}, repeats)
            for ratio in ratios:
                tps, stats = medians[ratio]
                rule = eng.bucket_shrink_ratio if ratio is None else ratio
                rows.append(row_of(name, batch, tps, stats, gcs[ratio], rule, buckets, waves, continuous, report, tier))
                tokens[(name, ratio)] = stats["tokens"]
        for row in rows[first:]:  # greedy: lossless up to bf16 near ties, per request
            ratio = row["bucket_shrink_ratio"] if shrink_ratios else None
            if ("jeagle", ratio) in tokens and row["system"] != "jeagle":
                row |= token_agreement(tokens[(row["system"], ratio)], tokens[("jeagle", ratio)])
            print(json.dumps(row), flush=True)
    return rows


def row_of(name, batch, tps, stats, gcs, ratio, buckets, waves, continuous, report, tier) -> dict:
    """One system's row at one batch size and bucket rule: the median run's tokens/s, where its time went."""
    row = {"system": name, "batch": batch, "tokens_per_s": round(tps, 1), "buckets": buckets,
           "bucket_shrink_ratio": ratio, "buckets_used": stats["buckets_used"]} | (
        {"waves": waves} if waves > 1 else {}) | ({"continuous": True} if continuous else {}) | (
        {"sampling": report} if report else {})
    # Where the median run's time went: decode steps / rounds dispatched, the engine's wall, the
    # host's blocked time per step, prompt tokens taken from the prefix cache.
    hb = stats["host_blocked_ms"] or {}
    row |= {"run_tokens_per_s": stats["run_tokens_per_s"], "steps": stats["steps"],
            "wall_s": round(stats["wall_s"], 3),
            "host_blocked_ms_p50": round(hb.get("p50", 0.0), 3),
            "cached_tokens": stats["cached_tokens"], "prefill_calls": stats["prefill_calls"],
            "admission_held_steps": stats["admission_held_steps"],
            "run_gc_ms": [g[0] for g in gcs], "run_gc_collections": [g[1] for g in gcs],
            "run_gc_full_collections": [g[2] for g in gcs]}
    if "grammar" in report:  # where a grammar batch's time goes
        row |= {"grammar_mask_ms": round(stats["grammar_mask_ms"], 1),
                "grammar_rows_walked": stats["grammar_rows_walked"],
                "grammar_rows_masked": stats["grammar_rows_masked"]}
    # The median run's tokens, digested: rows of separate processes (another allocator, another
    # machine) can then be compared token for token.
    row["tokens_sha1"] = hashlib.sha1(json.dumps(stats["tokens"]).encode()).hexdigest()[:16]
    if name == "jeagle-eagle":
        row |= {"accept_length": round(stats["accept_length"], 3), "tier": list(tier)}
    elif name == "jeagle-adaptive":
        row |= {"accept_length": round(stats["accept_length"], 3), "tiers": stats["tiers"],
                "dispatches_per_tier": stats["dispatches_per_tier"], "adaptive_state": stats.get("adaptive_state")}
    return row


def hf_rows(gguf: Path, prompts_ids, batches, max_new, repeats, pad_id: int, device: str = "cuda") -> list[dict]:
    """The transformers peer; device "cpu" (eager, no torch.compile) only checks this code path."""
    import torch
    from transformers import CompileConfig

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the hf peer needs CUDA")

    model = plain_hf_model(gguf).to(device).eval()
    model.generation_config.cache_implementation = "static"
    # transformers' own compile of a static-cache decode (generate compiles the decode forward, not the
    # prefill; CUDA graphs via reduce-overhead). Wrapping model.forward in torch.compile by hand instead
    # also compiles the prefill, and under transformers 5.17 its CUDA-graph outputs get overwritten
    # (RuntimeError on 2026-11-23, bench/HISTORY.md). It engages only on CUDA (checked after the first warm-up below).
    model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    rows = []
    for batch in batches:
        ids = batch_of(prompts_ids, batch)
        width = max(len(p) for p in ids)
        x = torch.tensor([[pad_id] * (width - len(p)) + p for p in ids], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=device)

        def once():
            with torch.no_grad():
                out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                                     do_sample=False, pad_token_id=pad_id)
            if device == "cuda":
                torch.cuda.synchronize()
            return (out.shape[1] - width) * batch, {}

        once()  # warm-up: torch.compile and CUDA graphs for this shape
        # generate() sets _compiled_call the first time its auto-compile criteria hold (and never clears
        # it): checked after the first batch size's warm-up, it says whether the compiled decode engaged.
        auto_compile_engaged = getattr(model, "_compiled_call", None) is not None
        if device == "cuda" and not auto_compile_engaged:
            raise RuntimeError("transformers did not compile the decode (its auto-compile criteria were not met)")
        tps, _ = median_run(once, repeats)
        row = {"system": "hf", "batch": batch, "tokens_per_s": round(tps, 1),
               "variant": "transformers generate, static cache, " + (
                   "compiled decode (torch.compile reduce-overhead, fullgraph), bf16" if auto_compile_engaged
                   else "eager on CPU (code-path check only)")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def plot_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The plot's lines: one per system and per value of whatever else varies between the rows (bucket
    rule, waves, continuous batching), each its (batch, tokens/s) points in batch order."""
    varying = [k for k in ("bucket_shrink_ratio", "waves", "continuous")  # hf rows carry none of them
               if len({json.dumps(r[k]) for r in rows if r.get(k) is not None}) > 1]
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        label = ", ".join([r["system"]] + [f"{k} {r[k]}" for k in varying if r.get(k) is not None])
        series.setdefault(label, []).append((r["batch"], r["tokens_per_s"]))
    return {label: sorted(pts) for label, pts in series.items()}


def plot(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: no plot (later: python bench/decode.py --plot-only JSON --plot {path})")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in plot_series(doc["rows"]).items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{doc['model']}, {doc['max_new_tokens']} new tokens, {doc['device']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct (the hf peer needs its GGUF)")
    p.add_argument("--draft", default=None, help="default: the shipped head")
    p.add_argument("--prompts", default=None, help=".jsonl with a 'prompt' per line (MT-bench first turns)")
    p.add_argument("--batch-sizes", default="1,4,16,48")
    p.add_argument("--hf-batch-sizes", default="1,16", help="empty: no hf peer")
    p.add_argument("--hf-device", default="cuda", choices=["cuda", "cpu"], help="cpu: eager, a code-path check only")
    p.add_argument("--tier", default="5,4,8", help="S,K,N of jeagle-eagle (the base tier of jeagle-adaptive)")
    p.add_argument("--systems", default=",".join(JEAGLE_SYSTEMS), help="jeagle systems to run")
    p.add_argument("--adaptive-config", default=None,
                   help="JSON file for jeagle-adaptive (default: the policy's defaults)")
    p.add_argument("--engine-config", default=None, metavar="JSON",
                   help='more EngineConfig fields for every jeagle system, e.g. \'{"verify_done_wait": "dataflow"}\'')
    p.add_argument("--sampling", default=None, metavar="JSON",
                   help='more SamplingParams fields for every jeagle request, e.g. {"logprobs": 5} or '
                        '{"frequency_penalty": 0.5} or {"grammar": ["json_schema", {...}]} (structured output: '
                        'requests end at EOS, tokens/s counts the tokens made): their rows say so')
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--kv-chunk", type=int, default=None,
                   help="positions a request's KV slots grow by ahead of need (default: runtime/kv.py's CHUNK)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--waves", type=int, default=1,
                   help="batches of distinct prompts timed one after another per batch size (batch 1 with "
                        "--waves 8: the first 8 prompts, one at a time); tokens/s over them all")
    p.add_argument("--continuous", action="store_true",
                   help="the --waves' prompts in one generate() with at most `batch` running (continuous batching)")
    p.add_argument("--freeze-heap", action="store_true",
                   help="freeze Python's heap after each engine's warm-up, as jeagle.serve does (every row reports "
                        "each run's garbage-collection time either way: run_gc_ms)")
    p.add_argument("--buckets", default="default", choices=["default", "batches"],
                   help="default: the engine's batch buckets (what a user gets); batches: the batch sizes only")
    p.add_argument("--bucket-shrink-ratios", default=None, metavar="X,Y,...",
                   help="time each system under each EngineConfig.bucket_shrink_ratio, the runs interleaved on one "
                        "engine (a row per ratio; default: the engine's own)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="PNG path")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="draw --plot from an earlier --json-out")
    args = p.parse_args(argv)
    if args.plot_only:
        doc = json.loads(Path(args.plot_only).read_text())
        plot(doc, args.plot or str(Path(args.plot_only).with_suffix(".png")))
        return doc

    import jax

    from jeagle.loading.fetch import resolve_draft, resolve_target, smollm2_gguf_path
    from jeagle.heads import default_head_dir
    from jeagle.loading.tokenizer import Tokenizer

    target_dir = resolve_target(args.target, quiet=True)
    head_dir = resolve_draft(args.draft or str(default_head_dir()), target_dir, quiet=True)
    tok = Tokenizer.from_dir(target_dir)
    texts = read_prompts(args.prompts, "Write a short story about a robot who learns to paint.")
    prompts_ids = chat_ids(tok, texts)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    try:
        engine_config = json.loads(args.engine_config) if args.engine_config else {}
    except json.JSONDecodeError as e:
        p.error(f"--engine-config: not JSON ({e})")
    from jeagle.engine import EngineConfig

    if not isinstance(engine_config, dict):
        p.error(f"--engine-config: a JSON object of EngineConfig fields, got {args.engine_config}")
    if bad := sorted(set(engine_config) - set(EngineConfig.__dataclass_fields__)):
        p.error(f"--engine-config: not EngineConfig fields: {bad}")
    if fixed := sorted(set(engine_config) & {"max_batch_size", "batch_buckets", "max_context"}):
        p.error(f"--engine-config: {fixed} follow from --batch-sizes and the prompts")
    if args.waves < 1:
        p.error("--waves: at least 1")
    if "kernels" in engine_config:
        p.error("--engine-config: kernels follow from the environment (JEAGLE_KERNELS, JEAGLE_PAGED_ATTENTION_SPLITS, "
                "JEAGLE_TRITON_GEMM, JEAGLE_XLA_OPTIONS)")
    ratios = sorted({float(x) for x in args.bucket_shrink_ratios.split(",")}) if args.bucket_shrink_ratios else None
    if ratios and ratios[0] < 1:
        p.error("--bucket-shrink-ratios: each at least 1")
    tier = tuple(int(x) for x in args.tier.split(","))
    doc = {"bench": "decode", "model": target_dir.name, "draft": str(head_dir), "prompts": args.prompts or "one prompt",
           "max_new_tokens": args.max_new_tokens, "device": device_kind(), "continuous": args.continuous,
           "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
           "jax": jax.__version__, "python": platform.python_version(), "commit": git_commit(),
           "freeze_heap": args.freeze_heap, "engine_config": engine_config,
           "sampling": json.loads(args.sampling) if args.sampling else None,
           "peers_not_run": {"eagle-llm": EAGLE_LLM_WHY}, "rows": []}
    systems = [x for x in args.systems.split(",") if x]
    if unknown := sorted(set(systems) - set(JEAGLE_SYSTEMS)):
        p.error(f"--systems: unknown {unknown} (known: {', '.join(JEAGLE_SYSTEMS)})")
    doc["rows"] += jeagle_rows(target_dir, head_dir, prompts_ids, batches, args.max_new_tokens, args.repeats, tier,
                               systems, args.adaptive_config, engine_config,
                               json.loads(args.sampling) if args.sampling else None, tok,
                               args.kv_chunk, args.waves, args.buckets, args.continuous, args.freeze_heap,
                               ratios)
    hf_batches = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    if hf_batches:
        if args.target is not None:
            doc["peers_not_run"]["hf"] = "--target given: the hf peer runs the SmolLM2 GGUF only"
        else:
            try:
                pad = tok.eos_token_ids[0] if getattr(tok, "eos_token_ids", None) else 0
                doc["rows"] += hf_rows(smollm2_gguf_path(quiet=True), prompts_ids, hf_batches, args.max_new_tokens,
                                       args.repeats, pad, args.hf_device)
            except Exception as e:  # a peer that cannot run is reported, not fatal
                doc["peers_not_run"]["hf"] = f"{type(e).__name__}: {e}"[:500]
                print(f"hf peer not run: {doc['peers_not_run']['hf']}", flush=True)
    # Against target-only at the same batch size (and bucket rule, with --bucket-shrink-ratios)
    base = {(r["batch"], r.get("bucket_shrink_ratio")): r["tokens_per_s"] for r in doc["rows"] if r["system"] == "jeagle"}
    hf = {r["batch"]: r["tokens_per_s"] for r in doc["rows"] if r["system"] == "hf"}
    for r in doc["rows"]:
        key = (r["batch"], r.get("bucket_shrink_ratio", doc["rows"][0].get("bucket_shrink_ratio")))  # hf: the first's
        if key in base:
            r["vs_jeagle_target_only"] = round(r["tokens_per_s"] / base[key], 2)
        if r["batch"] in hf:
            r["vs_hf"] = round(r["tokens_per_s"] / hf[r["batch"]], 2)
    print(f"\n{'system':<16} {'batch':>5} {'shrink':>6} {'tokens/s':>10} {'vs jeagle':>9} {'vs hf':>6} {'accept':>7}")
    for r in doc["rows"]:
        print(f"{r['system']:<16} {r['batch']:>5} {r.get('bucket_shrink_ratio', ''):>6} {r['tokens_per_s']:>10.1f} "
              f"{r.get('vs_jeagle_target_only', ''):>9} {r.get('vs_hf', ''):>6} {r.get('accept_length', ''):>7}")
    for peer, why in doc["peers_not_run"].items():
        print(f"not run: {peer}: {why}")
    if args.plot:
        plot(doc, args.plot)
    emit(doc, args.json_out)
    return doc


if __name__ == "__main__":
    main()
