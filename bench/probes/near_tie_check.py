"""Where greedy EAGLE parts from greedy target-only, is it a near tie?

For the first N MT-bench questions, runs target-only and EAGLE (the shipped head by default) greedily
in bf16 and in fp32. At the first token where the two part it prints the target's logit difference
between the two tokens, from one full forward over the prompt and the common prefix, in the run's
dtype and in fp32. A difference far under bf16's rounding (~0.1 logit here) means the parting is a
rounding difference between the decode step's and the verify forward's matmul shapes, not a
lossless bug. fp32 runs must not part at all: the exit status is 1 if one does.

    python bench/probes/near_tie_check.py --prompts .data/mtbench.jsonl --num-prompts 3 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common puts the repo root on the path

from common import chat_ids, prompt_logits, read_prompts  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=".data/mtbench.jsonl")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--draft", default=None, help="default: the shipped head")
    p.add_argument("--tier", default="5,4,8")
    args = p.parse_args(argv)

    from jeagle.checkpoint import load_draft, load_model
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.fetch import resolve_draft, resolve_target
    from jeagle.heads import default_head_dir
    from jeagle.kernels.settings import KernelSettings
    from jeagle.sampling import SamplingParams
    from jeagle.spec.round import SpecConfig
    from jeagle.tokenizer import Tokenizer

    target_dir = resolve_target(args.target, quiet=True)
    head_dir = resolve_draft(args.draft or str(default_head_dir()), target_dir, quiet=True)
    tok = Tokenizer.from_dir(target_dir)
    texts = read_prompts(args.prompts, "Write a short story about a robot who learns to paint.")[:args.num_prompts]
    prompts = chat_ids(tok, texts)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    fp32 = load_model(target_dir, dtype="float32")
    parted_fp32 = 0
    for dtype in ("bfloat16", "float32"):
        model = fp32 if dtype == "float32" else load_model(target_dir, dtype=dtype)
        head = load_draft(head_dir, target=model.cfg, dtype=dtype)
        ec = EngineConfig(max_batch_size=1, batch_buckets=(1,), max_context=max(map(len, prompts)) + args.max_new_tokens + 16,
                          kernels=KernelSettings.from_env())
        want = [o.token_ids for o in target_only(model, ec).generate(prompts, sp)]
        got = [o.token_ids for o in speculative(model, head, ec, SpecConfig(*map(int, args.tier.split(",")))).generate(prompts, sp)]
        for i, (a, b) in enumerate(zip(want, got)):
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            line = f"{dtype} prompt {i}: equal {a == b}"
            if at is not None:
                parted_fp32 += dtype == "float32"
                ids = prompts[i] + a[:at]
                line += f", parts at token {at} (target-only {a[at]}, EAGLE {b[at]})"
                for name, m in ((dtype, model), ("float32", fp32)):
                    lg = prompt_logits(m, ids)
                    line += (f"; {name} forward: argmax {int(lg.argmax())}, logit({a[at]}) - logit({b[at]}) = "
                             f"{lg[a[at]] - lg[b[at]]:+.4f}")
            print(line, flush=True)
    return 1 if parted_fp32 else 0


if __name__ == "__main__":
    sys.exit(main())
