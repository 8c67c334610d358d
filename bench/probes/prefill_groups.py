"""How the engine groups a batch's prompts into prefill dispatches (`Engine._admit_waiting`, the prefix
cache's `KVManager.shares_prefix`): each dispatch's row count, batch bucket, length bucket and context.

The real SmolLM2 target (with the shipped head for `--speculative`), the first `--batch` prompts of a
.jsonl through the chat template (`--copies`: the first prompt `--batch` times, as n > 1 sends it), one
`generate` of `--max-new-tokens` (default 1: the prefills are what is counted). On the CPU this takes a
minute or two. To count an older tree, put its jeagle first on PYTHONPATH: this probe imports jeagle
before bench/common (which would put this repository first).

    python bench/probes/prefill_groups.py --prompts .data/mtbench.jsonl --batch 48 --speculative
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--batch-buckets", default="16,48")
    p.add_argument("--copies", action="store_true", help="the first prompt, --batch times")
    p.add_argument("--speculative", action="store_true", help="EAGLE-3 with the shipped head (5,4,8)")
    p.add_argument("--max-new-tokens", type=int, default=1)
    args = p.parse_args(argv)

    import jeagle  # noqa: F401  (first: an older tree on PYTHONPATH stays the one imported)
    from jeagle.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig
    from jeagle.tokenizer import Tokenizer

    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    from common import chat_ids, read_prompts

    target_dir = resolve_target(None, quiet=True)
    model = load_model(target_dir)
    ids = chat_ids(Tokenizer.from_dir(target_dir), read_prompts(args.prompts, ""))
    prompts = [ids[0]] * args.batch if args.copies else [ids[i % len(ids)] for i in range(args.batch)]
    cfg = EngineConfig(max_batch_size=args.batch, batch_buckets=tuple(int(b) for b in args.batch_buckets.split(",")),
                       max_context=max(map(len, prompts)) + args.max_new_tokens + 16)
    if args.speculative:
        head = load_draft(resolve_draft(str(default_head_dir()), target_dir, quiet=True), target=model.cfg)
        eng = speculative(model, head, cfg, SpecConfig(5, 4, 8))
    else:
        eng = target_only(model, cfg)
    groups = []
    prefill = eng.decoder.prefill

    def counting(reqs, b, t, *a, **k):
        groups.append({"rows": len(reqs), "batch_bucket": b, "length_bucket": t, "context": k.get("context", 0)})
        return prefill(reqs, b, t, *a, **k)
    eng.decoder.prefill = counting
    eng.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))
    print(f"{len(groups)} prefill dispatches for {args.batch} prompts: rows {[g['rows'] for g in groups]}")
    print(json.dumps({"probe": "prefill_groups", "jeagle": str(Path(jeagle.__file__).parent), "batch": args.batch,
                      "copies": args.copies, "speculative": args.speculative, "dispatches": len(groups),
                      "groups": groups}))


if __name__ == "__main__":
    main()
