"""Issue 22: are the outputs right under another device allocator (XLA_PYTHON_CLIENT_ALLOCATOR=vmm)?

Greedy SmolLM2 (bf16) target-only and EAGLE (the shipped head) over the first `--prompts-n` MT-bench
questions at batch 1 and at batch `--batch`; prints each system's text of the first question and every
request's common prefix with target-only, and writes the tokens (JSON) for a comparison across processes
(allocators).

    XLA_PYTHON_CLIENT_ALLOCATOR=vmm python bench/probes/alloc_check.py --prompts .data/mtbench.jsonl --json-out vmm.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import chat_ids, device_kind, emit, git_commit, read_prompts  # noqa: E402


def common(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--prompts-n", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    from jeagle.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig
    from jeagle.tokenizer import Tokenizer

    target_dir = resolve_target(None, quiet=True)
    tok = Tokenizer.from_dir(target_dir)
    model = load_model(target_dir)
    head = load_draft(resolve_draft(str(default_head_dir()), target_dir, quiet=True), target=model.cfg)
    ids = chat_ids(tok, read_prompts(args.prompts, ""))[: args.prompts_n]
    ec = EngineConfig(max_batch_size=args.batch, max_context=max(map(len, ids)) + args.max_new_tokens + 16)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    doc = {"probe": "alloc_check", "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
           "device": device_kind(), "commit": git_commit(), "tokens": {}}
    engines = {"target": target_only(model, ec), "eagle": speculative(model, head, ec, SpecConfig(5, 4, 8))}
    for name, eng in engines.items():
        for mode in ("b1", f"b{args.batch}"):
            outs, accept = [], []  # batch 1: the questions one after another, each one's accept length
            for group in ([[x] for x in ids] if mode == "b1" else [ids]):
                outs += eng.generate(group, sp)
                accept.append(eng.last_stats.accept_length)
            doc["tokens"][f"{name}_{mode}"] = [o.token_ids for o in outs]
            doc.setdefault("accept", {})[f"{name}_{mode}"] = accept
    ref = doc["tokens"]["target_b1"]
    for key, rows in doc["tokens"].items():
        print(f"{key:<10} common prefix with target_b1: {[common(a, b) for a, b in zip(rows, ref)]}")
        print(f"           {tok.decode(rows[0])[:160]!r}")
    emit(doc, args.json_out)


if __name__ == "__main__":
    main()
